"""tierlm.platforms: knows the machine and decides; owns no tensors and imports neither torch nor mlx at load.

    facts = detect()
    decision = choose_backend(facts, os.environ, args.device)
    tiers = size_kv_tiers(facts, decision, args, weight_bytes=..., kv_bytes_per_token=..., context_length=...)
    for line in pitfalls(facts, os.environ) + tiers.warnings: logger.warning(line)
"""
from tierlm.platforms.backend_choice import BackendChoiceError, Decision, choose_backend
from tierlm.platforms.cpu_features import CpuFeatures, CpuIsaError, this_cpu
from tierlm.platforms.facts import Facts, detect
from tierlm.platforms.install_commands import install_command, install_set, mlx_install_command
from tierlm.platforms.memory_plan import (MemoryPlan, MemoryPlanError, TierPlan, plan_memory, plan_memory_for_args,
                                          size_kv_tiers)
from tierlm.platforms.pitfalls import pitfalls

__all__ = [
    "BackendChoiceError", "CpuFeatures", "CpuIsaError", "Decision", "Facts", "MemoryPlan", "MemoryPlanError",
    "choose_backend", "detect",
    "install_command", "install_set", "mlx_install_command", "pitfalls", "plan_memory", "plan_memory_for_args",
    "size_kv_tiers", "this_cpu", "TierPlan",
]
