# Warning and sanitizer flags shared by every ferry target.

add_library(ferry_options INTERFACE)
target_compile_options(ferry_options INTERFACE -Wall -Wextra -Wpedantic -Wshadow -Wconversion
                                               -Wno-sign-conversion)
if(FERRY_WERROR)
  target_compile_options(ferry_options INTERFACE -Werror)
endif()
if(FERRY_SANITIZE)
  target_compile_options(ferry_options INTERFACE -fsanitize=address,undefined
                                                 -fno-sanitize-recover=undefined
                                                 -fno-omit-frame-pointer)
  target_link_options(ferry_options INTERFACE -fsanitize=address,undefined)
endif()
if(FERRY_FUZZ)
  # Coverage for libFuzzer on every ferry target; the harnesses add the fuzzer's main.
  target_compile_options(ferry_options INTERFACE -fsanitize=fuzzer-no-link,address,undefined
                                                 -fno-sanitize-recover=undefined
                                                 -fno-omit-frame-pointer)
  target_link_options(ferry_options INTERFACE -fsanitize=address,undefined)
endif()

# ferry_library_options: ferry_options for the libraries' own sources (the core and the
# simulator's layers). Under the sanitizers, whose build is otherwise unoptimized, they are
# compiled at -O1, as AddressSanitizer's documentation advises for usable speed: the tests spend
# their time in the simulator and the planner. Two planner tests under the sanitizers took 742 s
# with the libraries at -O0 and 141 s at -O1 (5.3 times less), for 22 % more compile time of
# the libraries' sources (646 s to 788 s of CPU). The tests' own sources stay at -O0, where
# RapidCheck's and GoogleTest's templates would cost compile time and save no run time.
add_library(ferry_library_options INTERFACE)
target_link_libraries(ferry_library_options INTERFACE ferry_options)
if(FERRY_SANITIZE)
  target_compile_options(ferry_library_options INTERFACE -O1)
endif()
