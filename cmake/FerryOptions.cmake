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
