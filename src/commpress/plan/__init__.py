"""``commpress plan``: predict what compression buys on a given cluster."""

from commpress.plan.cost import ClusterSpec, JobSpec, plan, plan_policy

__all__ = ["ClusterSpec", "JobSpec", "plan", "plan_policy"]
