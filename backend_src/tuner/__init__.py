"""The SLA tuner: replays a workload through the real Scheduler in virtual time, with step costs measured on the
host, to choose engine options in seconds, then checks the choice on the real server (`python -m tuner`).

Modules: cli (the subcommands), calibrate (timing real steps), cost (the step-cost model), trace (workload
traces), sim (the virtual-time replay), search (choosing options for an SLA), verify (replay on tritonserver),
prefixes (prefix-cache hit rates), config_writer (tuned llm/configs/*.pbtxt), report (Markdown and plots).
"""
