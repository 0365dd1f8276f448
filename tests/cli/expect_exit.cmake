# Runs CMD (a ;-list) and checks its exit code is EXPECT and, if given, that its combined
# output matches the regular expression MATCH.
execute_process(COMMAND ${CMD} RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT code STREQUAL "${EXPECT}")
  message(FATAL_ERROR "exit code ${code}, expected ${EXPECT}\nstdout:\n${out}\nstderr:\n${err}")
endif()
if(DEFINED MATCH AND NOT "${out}${err}" MATCHES "${MATCH}")
  message(FATAL_ERROR "output does not match '${MATCH}'\nstdout:\n${out}\nstderr:\n${err}")
endif()
