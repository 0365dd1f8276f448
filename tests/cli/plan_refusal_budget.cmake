# `ferry plan` with PLAN_ARGS (a ;-list of its arguments, with no --budget) at the budget
# REFUSED: refused (exit 1), its text naming the smallest budget that plans and its --json
# document giving it (smallest_budget_bytes); then at that budget it plans (exit 0).
execute_process(COMMAND ${FERRY} plan ${PLAN_ARGS} --budget ${REFUSED} --json
                RESULT_VARIABLE code OUTPUT_VARIABLE document ERROR_VARIABLE text)
if(NOT code EQUAL 1)
  message(FATAL_ERROR "at ${REFUSED}: exit code ${code}, expected 1\n${document}\n${text}")
endif()
string(JSON format GET "${document}" format)
if(NOT format STREQUAL "ferry.plan-refusal/1")
  message(FATAL_ERROR "the refusal's document is ${format}\n${document}")
endif()
string(JSON budget GET "${document}" smallest_budget_bytes)
if(NOT budget MATCHES "^[0-9]+$")
  message(FATAL_ERROR "the refusal names no smallest budget\n${document}\n${text}")
endif()
if(NOT text MATCHES "${MATCH}")
  message(FATAL_ERROR "the refusal does not match '${MATCH}'\n${text}")
endif()
if(NOT text MATCHES "smallest budget that plans[^;]* is [^;]*\\(${budget} bytes")
  message(FATAL_ERROR "the refusal's text does not name ${budget} bytes\n${text}")
endif()
execute_process(COMMAND ${FERRY} plan ${PLAN_ARGS} --budget ${budget} RESULT_VARIABLE code
                OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT code EQUAL 0)
  message(FATAL_ERROR "at the smallest budget ${budget}: exit code ${code}\n${out}\n${err}")
endif()
message(STATUS "refused at ${REFUSED}; plans at the smallest budget it names, ${budget} bytes")
