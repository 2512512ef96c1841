"""The installed DeepSpeed's own schema for ``zero_optimization`` and ``compile``, as one-line errors.

Why not a key list of our own: ZeRO-3's settings move between releases (0.19.8 added ``compute_grad_norm``
and ``parameter_alignment``; 0.19.2 still had ``mics_shard_size``), and DeepSpeed's pydantic models
(``extra="forbid"``) know exactly what the installed release reads. DeepSpeed raises their errors only when
the engine is built, after the process group, the model and the C++ op build, and as a multi-line pydantic
dump; here they are checked before any model exists and named by key, value and DeepSpeed version.

Pairs DeepSpeed refuses only at ``engine.compile()`` (or silently mis-handles) are checked here too:
DeepCompile needs CUDA, and its offload passes exclude ZeRO's own offload of the same states.
"""

from __future__ import annotations

import difflib
from typing import Any

from dsclip.config_base import ConfigError


def _version() -> str:
    import deepspeed

    return deepspeed.__version__


def _field_names(model) -> list[str]:
    names = []
    for name, f in model.model_fields.items():
        names.append(name)
        if f.alias:
            names.append(f.alias)
    return sorted(set(names))


def _submodel(model, key: str):
    """The pydantic model of a nested block (``offload_param``), or None for a plain value."""
    for name, f in model.model_fields.items():
        if key in (name, f.alias):
            ann = f.annotation
            for cand in (ann, *getattr(ann, "__args__", ())):
                if isinstance(cand, type) and hasattr(cand, "model_fields"):
                    return cand
    return None


def _validate(model, section: dict, prefix: str) -> None:
    """One line for the first problem DeepSpeed's model finds in ``section`` (``prefix`` = its JSON path)."""
    import pydantic

    try:
        model(**section)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"]]
        key = ".".join([prefix, *loc])
        if err["type"] == "extra_forbidden":
            owner = model
            for part in loc[:-1]:
                owner = _submodel(owner, part) or owner
            close = difflib.get_close_matches(loc[-1], _field_names(owner), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                f"unknown key '{key}': DeepSpeed {_version()} has no such setting{hint} "
                f"(remove it, or install the DeepSpeed release that has it)"
            ) from None
        raise ConfigError(
            f"{key} = {err.get('input')!r}: {err['msg']} (DeepSpeed {_version()}); fix the value"
        ) from None
    except (ValueError, TypeError, AssertionError) as e:  # DeepSpeed's own validators outside pydantic's
        raise ConfigError(f"{prefix}: {e} (DeepSpeed {_version()})") from None


def check_zero_and_compile(ds: dict[str, Any], where: str, device_type: str) -> None:
    """Refuse, in one line naming the key and the installed DeepSpeed, what the engine build would refuse."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    zero = ds.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"{where}: 'zero_optimization' must be a JSON object")
    try:
        _validate(DeepSpeedZeroConfig, zero, "zero_optimization")
        compile_cfg = ds.get("compile")
        if compile_cfg is not None:
            _check_compile(compile_cfg, zero, device_type)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def _compile_model():
    from deepspeed.compile.config import CompileConfig  # where 0.19.2 to 0.19.8 define it

    return CompileConfig


def _check_compile(compile_cfg: Any, zero: dict, device_type: str) -> None:
    if not isinstance(compile_cfg, dict):
        raise ConfigError("'compile' must be a JSON object")
    _validate(_compile_model(), compile_cfg, "compile")
    if not compile_cfg.get("deepcompile"):
        return
    version = _version()
    if device_type != "cuda":
        raise ConfigError(
            f"compile.deepcompile needs a CUDA device (DeepSpeed {version} compiles its passes for CUDA only); "
            f"this run's accelerator is {device_type}: remove the 'compile' block here"
        )
    stage = zero.get("stage", 0)
    if stage not in (1, 2, 3):
        raise ConfigError(f"compile.deepcompile needs ZeRO stage 1, 2 or 3 (DeepSpeed {version}); stage is {stage}")
    # DeepSpeed's own rules (compile/init_z3.py, 0.19.8), refused there only at engine.compile(), after the
    # model is built. ZeRO offloading both parameters and optimizer to cpu turns offload_parameters on.
    offloaded = {k: (zero.get(k) or {}).get("device", "none") for k in ("offload_optimizer", "offload_param")}
    params_pass = compile_cfg.get("offload_parameters") or (
        offloaded["offload_optimizer"] == "cpu" and offloaded["offload_param"] == "cpu"
    )
    opt_pass = compile_cfg.get("offload_opt_states")
    if opt_pass and offloaded["offload_optimizer"] in ("cpu", "nvme"):
        raise ConfigError(
            f"compile.offload_opt_states with zero_optimization.offload_optimizer.device = "
            f"{offloaded['offload_optimizer']!r}: DeepSpeed {version} manages the optimizer states either through "
            f"DeepCompile or through ZeRO's offload, not both; drop one of the two"
        )
    if opt_pass and params_pass:
        raise ConfigError(
            f"compile.offload_opt_states with compile.offload_parameters (on by itself when ZeRO offloads both "
            f"parameters and optimizer to cpu): DeepSpeed {version} runs one offload pass at a time; keep one"
        )
    if compile_cfg.get("offload_activation") and (params_pass or opt_pass):
        raise ConfigError(
            f"compile.offload_activation with compile.offload_parameters/offload_opt_states: DeepSpeed {version} "
            f"runs one offload pass at a time; keep one"
        )
