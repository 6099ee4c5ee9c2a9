"""`carpool bench`: drive a running Carpool over REST with a realistic load and report it."""

from loadgen.load_generator import LoadGenerator, LoadReport, RequestRecord
from loadgen.workload import WorkloadItem, build_workload

__all__ = ["LoadGenerator", "LoadReport", "RequestRecord", "WorkloadItem", "build_workload"]
