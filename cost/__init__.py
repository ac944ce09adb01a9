"""The cost model and the planner. Importing the package loads the plan text
(autopar/report.py registers `print(plan)` / `plan.explain()` with autopar.plan), so the
plans the solver hands out print as the user expects."""
from autopar import report as _report  # noqa: F401 (registers Plan's renderers)
