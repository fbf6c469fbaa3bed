// What every compile-fail case includes, precompiled once (test/meson.build):
// each case then parses in about a third of the time.
#include <gshard/gshard.hpp>
