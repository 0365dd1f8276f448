# Plans with PLAN_ARGS (a ;-list of `ferry plan` arguments) into PLAN, checks the plan file
# records the parallelism member PARALLELISM (its JSON text), then replays it with
# `ferry simulate --model MODEL --plan PLAN --keep-grads` (the gradients held between steps, as
# the planner holds them; nothing else on the command line) and checks the replay's step time
# and peak reserved memory are the plan report's.
execute_process(COMMAND ${FERRY} plan ${PLAN_ARGS} --json --out ${PLAN} RESULT_VARIABLE code
                OUTPUT_VARIABLE planned ERROR_VARIABLE err)
if(NOT code EQUAL 0)
  message(FATAL_ERROR "ferry plan: exit code ${code}\n${planned}\n${err}")
endif()
file(READ ${PLAN} plan_text)
string(JSON recorded ERROR_VARIABLE missing GET "${plan_text}" parallelism)
if(missing)
  message(FATAL_ERROR "the plan file records no parallelism: ${missing}\n${plan_text}")
endif()
string(JSON same EQUAL "${recorded}" "${PARALLELISM}")
if(NOT same)
  message(FATAL_ERROR "the plan file's parallelism is ${recorded}, expected ${PARALLELISM}")
endif()
execute_process(COMMAND ${FERRY} simulate --model ${MODEL} --plan ${PLAN} --keep-grads --json
                RESULT_VARIABLE code OUTPUT_VARIABLE replayed ERROR_VARIABLE err)
if(NOT code EQUAL 0)
  message(FATAL_ERROR "ferry simulate --plan: exit code ${code}\n${replayed}\n${err}")
endif()
foreach(field step_time_ns peak_reserved_bytes)
  string(JSON planned_value GET "${planned}" ${field})
  string(JSON replayed_value GET "${replayed}" result ${field})
  if(NOT planned_value STREQUAL replayed_value)
    message(FATAL_ERROR "${field}: the plan's ${planned_value}, its replay's ${replayed_value}")
  endif()
  message(STATUS "${field}: ${planned_value} planned and replayed")
endforeach()
