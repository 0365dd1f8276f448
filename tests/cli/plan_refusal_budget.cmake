# `ferry plan` with PLAN_ARGS (a ;-list of its arguments, with no --budget) at the budget
# REFUSED: refused (exit 1), its text naming the floor, the smallest budget that plans, and its
# --json document giving it (floor_bytes, the same as smallest_budget_bytes, with the smallest
# peak reserved as peak_floor_bytes); then at that budget it plans (exit 0) and one byte less is
# refused (docs/plan.md, "A budget below the floor"). Where the margin puts the floor above the
# peak, the peak, asked for as a budget, is refused too, and the floor that refusal names plans.

# Refused at `budget`: sets `floor` and `peak` in the caller to the bytes its document names.
function(refused_at budget)
  execute_process(COMMAND ${FERRY} plan ${PLAN_ARGS} --budget ${budget} --json
                  RESULT_VARIABLE code OUTPUT_VARIABLE document ERROR_VARIABLE text)
  if(NOT code EQUAL 1)
    message(FATAL_ERROR "at ${budget}: exit code ${code}, expected 1\n${document}\n${text}")
  endif()
  string(JSON format GET "${document}" format)
  if(NOT format STREQUAL "ferry.plan-refusal/1")
    message(FATAL_ERROR "the refusal's document is ${format}\n${document}")
  endif()
  string(JSON named GET "${document}" floor_bytes)
  string(JSON smallest GET "${document}" smallest_budget_bytes)
  string(JSON least GET "${document}" peak_floor_bytes)
  if(NOT named MATCHES "^[0-9]+$" OR NOT least MATCHES "^[0-9]+$")
    message(FATAL_ERROR "the refusal at ${budget} names no floor\n${document}\n${text}")
  endif()
  if(NOT smallest STREQUAL named)
    message(FATAL_ERROR "floor_bytes ${named} and smallest_budget_bytes ${smallest} differ")
  endif()
  if(least GREATER named)
    message(FATAL_ERROR "the peak ${least} is above the floor ${named}\n${document}")
  endif()
  if(NOT text MATCHES "${MATCH}")
    message(FATAL_ERROR "the refusal does not match '${MATCH}'\n${text}")
  endif()
  if(NOT text MATCHES "smallest budget that plans[^;]* is [^;]*\\(${named} bytes")
    message(FATAL_ERROR "the refusal's text does not name ${named} bytes\n${text}")
  endif()
  set(floor ${named} PARENT_SCOPE)
  set(peak ${least} PARENT_SCOPE)
endfunction()

# The floor plans, and one byte less is refused.
function(plans_from floor)
  execute_process(COMMAND ${FERRY} plan ${PLAN_ARGS} --budget ${floor} RESULT_VARIABLE code
                  OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT code EQUAL 0)
    message(FATAL_ERROR "at the floor ${floor}: exit code ${code}\n${out}\n${err}")
  endif()
  math(EXPR less "${floor} - 1")
  execute_process(COMMAND ${FERRY} plan ${PLAN_ARGS} --budget ${less} RESULT_VARIABLE code
                  OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT code EQUAL 1)
    message(FATAL_ERROR "one byte under the floor, ${less}: exit code ${code}\n${out}\n${err}")
  endif()
endfunction()

refused_at(${REFUSED})
plans_from(${floor})
message(STATUS "refused at ${REFUSED}; plans at the floor it names, ${floor} bytes, not at one less")
if(peak LESS floor)
  refused_at(${peak})
  plans_from(${floor})
  message(STATUS "refused at the peak ${peak}; plans at the floor it names, ${floor} bytes")
endif()
