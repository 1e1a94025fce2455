"""Simulator: the real core/ scheduler and KV cache manager on a modelled GPU.

A roofline cost model stands in for the model runner, so admission, preemption, prefix reuse
and chunking decisions are exactly the engine's while time is virtual. See README.md here.
"""

from kvserve.sim.calibrate import FitResult, StepRecord, fit_efficiency, load_step_records
from kvserve.sim.cost_model import CostModel, Efficiency, StepCost, StepShape
from kvserve.sim.deployment import MemoryPlan, plan_memory
from kvserve.sim.hardware import HARDWARE, HardwareSpec, get_hardware
from kvserve.sim.specs import PRESETS, ModelSpec, get_model_spec, model_from_hf_config
from kvserve.sim.workloads import WorkloadRequest, generate_workload, load_jsonl, save_jsonl

__all__ = [
    "HARDWARE",
    "PRESETS",
    "CostModel",
    "Efficiency",
    "FitResult",
    "HardwareSpec",
    "MemoryPlan",
    "ModelSpec",
    "StepCost",
    "StepRecord",
    "StepShape",
    "WorkloadRequest",
    "fit_efficiency",
    "generate_workload",
    "get_hardware",
    "get_model_spec",
    "load_jsonl",
    "load_step_records",
    "model_from_hf_config",
    "plan_memory",
    "save_jsonl",
]
