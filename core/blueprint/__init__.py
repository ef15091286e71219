"""The blueprint: one YAML file that describes a whole post-training run.

sections.py: one model per section and its field rules; blueprint.py: the root `Blueprint`, its cross-field rules
and section hashes; load.py: YAML, overrides and errors that name the line. It describes: whether a run is
runnable here (files, models, rewards, the store's room, memory) is core/checks'. Of verlflow it imports only the
leaves core.errors, core.algos, core.uris and core.userstage (a user stage's class is imported to check the inputs
it lists, so that the error names the YAML line).
"""

from verlflow.core.blueprint.blueprint import Blueprint
from verlflow.core.blueprint.load import (MAX_YAML_BYTES, MAX_YAML_VALUES, apply_overrides, format_validation_error,
                                          json_schema, load_blueprint, parse_override, resolve_paths)
from verlflow.core.blueprint.sections import (ADV_ESTIMATORS, DPO_LOSSES, KL_TYPES, PHASE_KINDS, POLICY_LOSSES,
                                              AgentSpec, AlgorithmSpec, DataSpec, EvalSpec, FilterGroupsSpec, FSDPSpec,
                                              KubernetesSpec, LoraSpec, ModelSpec, OptimSpec, OptionalText,
                                              OverlongBufferSpec, PhaseDataSpec, PhaseResourcesSpec, PhaseSpec,
                                              PromoteSpec, ResourcesSpec, RewardCombineSpec, RewardModelSpec,
                                              RewardSpec, RolloutSpec, ScheduleSpec, Section, SlurmSpec, StorageSpec,
                                              SupervisedSpec, TrackingSpec)

__all__ = [
    "ADV_ESTIMATORS", "DPO_LOSSES", "KL_TYPES", "MAX_YAML_BYTES", "MAX_YAML_VALUES", "PHASE_KINDS", "POLICY_LOSSES",
    "AgentSpec", "AlgorithmSpec", "Blueprint", "DataSpec", "EvalSpec", "FilterGroupsSpec", "FSDPSpec", "KubernetesSpec",
    "LoraSpec", "ModelSpec", "OptimSpec", "OptionalText", "OverlongBufferSpec", "PhaseDataSpec", "PhaseResourcesSpec",
    "PhaseSpec", "PromoteSpec", "ResourcesSpec", "RewardCombineSpec", "RewardModelSpec", "RewardSpec", "RolloutSpec",
    "ScheduleSpec", "Section", "SlurmSpec", "StorageSpec", "SupervisedSpec", "TrackingSpec", "apply_overrides",
    "format_validation_error", "json_schema", "load_blueprint", "parse_override", "resolve_paths",
]
