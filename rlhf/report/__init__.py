"""What `rlhf plan` and `rlhf simulate` print about a run config before anything starts: its placement, memory
and weight-sync plan (`plan`), and its predicted step, the search's ranking and the best configuration
(`simulate`). Pure; the one layer that reads both the placement (`rlhf.placement`) and the cost model
(`rlhf.sim`).
"""

from rlhf.report.plan import plan_report
from rlhf.report.simulate import candidate_of, memory_by_role, search_config, simulate, write_config

__all__ = ["candidate_of", "memory_by_role", "plan_report", "search_config", "simulate", "write_config"]
