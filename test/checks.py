"""What the test scripts share: the verdict line scripts/summarize.py reads."""


def verdict(problems, ranks):
    """Prints each problem and the summary line; returns the exit code."""
    for p in problems:
        print(p)
    ok = not problems
    print(f"gshard-test-summary: passed={int(ok)} failed={int(not ok)} ranks={ranks}")
    return 0 if ok else 1
