"""ScheduleAuto and what it measures and plans with: schedule_auto (the steps), auto_plan (the
plan, pure), measurements (the measuring recipe plan_partition and `zbpipe bench` share),
stage_costs (costs read from a trace) and memory_probe (the saved bytes of a probing step).

Their old paths (zbpipe.schedule_auto, zbpipe.stage_costs, ...) name these same modules
(zbpipe/__init__.py registers them), so older imports keep working.
"""

# The modules, in the order zbpipe/__init__.py registers their old paths.
MODULES = ("stage_costs", "memory_probe", "measurements", "auto_plan", "schedule_auto")
