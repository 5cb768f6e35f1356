"""The one adapter between this project and every TensorRT-LLM version it admits.

What the tensorrt_llm target uses of TensorRT-LLM, and where it differs between versions
(read in TensorRT-LLM's own sources; docs/gpu.md has the table and the evidence):

- public, in every admitted version: `tensorrt_llm.LLM`, `tensorrt_llm.SamplingParams`,
  `tensorrt_llm.llmapi.KvCacheConfig`, `tensorrt_llm.llmapi.UserProvidedDecodingConfig`.
- `Drafter`, the base class of a user drafter, is exported by no public module in any of
  them; `tensorrt_llm._torch.speculative.drafter` is the only path (its own tests import
  from there). Its constructor changed twice (`DRAFTER_FORMS`).
- a request's `sampling_config`: each parameter a one-element list (or None) and the
  seed named `random_seed` (the C++ `SamplingConfig` binding), or plain scalars with the
  seed named `seed` (TensorRT-LLM's sampler after the C++ sampler goes). `sampling_value`
  reads both.

Versions outside `SUPPORTED_TENSORRT_LLM` are refused when the target starts, naming the
installed version: after 1.2, TensorRT-LLM removed the two-model speculative path
(TensorRT-LLM #18721, September 2026), and nothing later is checked. So is a `Drafter`
whose constructor is none of the known forms. Nothing here imports TensorRT-LLM at import
time; `import_tensorrt_llm` does, where a target starts.
"""
from __future__ import annotations

import importlib
import inspect
import re
import sys
from dataclasses import dataclass
from typing import Any

from saguaro.runtime.core.sampling import SamplingParams

SUPPORTED_TENSORRT_LLM = ((1, 0), (1, 3))  # [lowest, first unchecked)
TENSORRT_LLM_REQUIREMENT = "tensorrt-llm>=1.0,<1.3"
TENSORRT_LLM_INSTALL_HINT = (f"pip install '{TENSORRT_LLM_REQUIREMENT}' --extra-index-url https://pypi.nvidia.com "
                             "(CUDA GPU machines; docs/gpu.md says how to install it offline)")
DRAFTER_MODULE = "saguaro.runtime.engines.tensorrt_llm_drafter"


# --- versions --------------------------------------------------------------------------

def release(version: str) -> tuple[int, int]:
    """(major, minor) of a TensorRT-LLM version string such as "1.2.0rc6.post2"."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"TensorRT-LLM version {version!r} is not of the form MAJOR.MINOR...")
    return int(match.group(1)), int(match.group(2))


def check_tensorrt_llm_version(version: str) -> None:
    lowest, unchecked = SUPPORTED_TENSORRT_LLM
    if not lowest <= release(version) < unchecked:
        raise ImportError(f"TensorRT-LLM {version} is not supported: the tensorrt_llm target is written and "
                          f"checked for {TENSORRT_LLM_REQUIREMENT} ({TENSORRT_LLM_INSTALL_HINT})")


def installed_version() -> str:
    """The version of the TensorRT-LLM imported in this process (for error messages)."""
    module = sys.modules.get("tensorrt_llm")
    return getattr(module, "__version__", "(not imported)")


# --- the Drafter constructor -------------------------------------------------------------

@dataclass(frozen=True)
class DrafterForm:
    """One form of `Drafter.__init__`: its parameters, which of them carry the draft
    length K, and the attributes the base class reads K from without setting them."""

    parameters: tuple[str, ...]
    draft_length_arguments: tuple[str, ...]
    draft_length_attributes: tuple[str, ...] = ()
    versions: str = ""


DRAFTER_FORMS = (
    # 1.0.x, 1.1.x: padding reads the subclass's max_draft_len (max_draft_tokens on the
    # 1.1 line), which the base never sets
    DrafterForm(("max_concurrency",), (), ("max_draft_len", "max_draft_tokens"), "1.0 - 1.1"),
    # 1.2.0 release candidates (dynamic draft length, stage 1)
    DrafterForm(("max_draft_tokens", "max_concurrency", "draft_len_schedule"), ("max_draft_tokens",),
                versions="1.2.0rc"),
    # 1.2.x (draft trees: the total may exceed the depth; a chain has total = depth)
    DrafterForm(("max_draft_len", "max_total_draft_tokens", "max_concurrency", "draft_len_schedule"),
                ("max_draft_len", "max_total_draft_tokens"), versions="1.2"),
)


def drafter_form(drafter_base: Any) -> DrafterForm:  # a class of (untyped) TensorRT-LLM
    """The form of `drafter_base.__init__`, or a RuntimeError naming the installed
    TensorRT-LLM and the parameters it has."""
    parameters = tuple(name for name in inspect.signature(drafter_base.__init__).parameters
                       if name not in ("self", "args", "kwargs"))
    for form in DRAFTER_FORMS:
        if parameters == form.parameters:
            return form
    known = "; ".join(f"({', '.join(form.parameters)}) in {form.versions}" for form in DRAFTER_FORMS)
    raise RuntimeError(f"TensorRT-LLM {installed_version()}: Drafter.__init__({', '.join(parameters)}) is none of the "
                       f"forms the SSD drafter knows ({known}); supported: {TENSORRT_LLM_REQUIREMENT}")


def init_drafter_base(drafter, drafter_base: Any, draft_length: int) -> None:  # as in `drafter_form`
    """Run `drafter_base.__init__` on `drafter` for a draft length of K (a chain: the
    total draft tokens per request is K), in whichever form the installed version has."""
    form = drafter_form(drafter_base)
    drafter_base.__init__(drafter, **{name: draft_length for name in form.draft_length_arguments})
    for name in form.draft_length_attributes:
        setattr(drafter, name, draft_length)


# --- a request's sampling config -----------------------------------------------------------

def sampling_value(config, *names):
    """The first of `names` that `config` has, as a scalar: a one-element list (the C++
    binding's form) is unwrapped, None and an empty list are None. A longer list (several
    beams) is refused: the drafter drafts one sequence per request."""
    for name in names:
        if hasattr(config, name):
            value = getattr(config, name)
            break
    else:
        return None
    if value is None or isinstance(value, (int, float)):
        return value
    values = list(value)
    if len(values) > 1:
        raise ValueError(f"TensorRT-LLM {installed_version()}: sampling_config.{name} holds {len(values)} values; "
                         "the SSD drafter drafts for one beam")
    return values[0] if values else None


def check_sampling_config(config) -> None:
    """A sampling config of a form `sampling_value` knows: the three parameters present."""
    missing = [name for name in ("temperature", "top_k", "top_p") if not hasattr(config, name)]
    if missing:
        raise RuntimeError(f"TensorRT-LLM {installed_version()}: a request's sampling_config has no {missing}; "
                           f"supported: {TENSORRT_LLM_REQUIREMENT}")


def request_sampling(sampling_config) -> SamplingParams:
    """Our `SamplingParams` for a TensorRT-LLM request's sampling config, with its greedy
    rule (`SamplingParams.params_imply_greedy_decoding`): temperature 0, top-k 1, top-p 0,
    or nothing set. The seed is `random_seed` or `seed`, whichever the version names."""
    check_sampling_config(sampling_config)
    temperature = sampling_value(sampling_config, "temperature")
    top_k, top_p = sampling_value(sampling_config, "top_k"), sampling_value(sampling_config, "top_p")
    seed = sampling_value(sampling_config, "random_seed", "seed")
    seed = None if seed is None else int(seed)
    greedy = (temperature is None and top_k is None and top_p is None) or temperature == 0 or top_k == 1 \
        or top_p == 0
    if greedy:
        return SamplingParams(seed=seed)
    return SamplingParams(temperature=float(temperature or 1.0), top_k=int(top_k or 0),
                          top_p=float(1.0 if top_p is None else top_p), seed=seed)


# --- the import ------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorRTLLMApi:
    """The parts of TensorRT-LLM the target uses."""

    version: str
    LLM: type
    SamplingParams: type
    KvCacheConfig: type
    UserProvidedDecodingConfig: type
    Drafter: type


def import_tensorrt_llm() -> TensorRTLLMApi:
    """TensorRT-LLM's API (and our drafter class built on it), or an ImportError saying how
    to get it; a version outside the supported range, or a Drafter of unknown form, is
    refused here, before the LLM starts."""
    try:
        import tensorrt_llm
        from tensorrt_llm import LLM, SamplingParams as LlmSamplingParams
        from tensorrt_llm.llmapi import KvCacheConfig, UserProvidedDecodingConfig
    except ImportError as error:
        raise ImportError(f"the tensorrt_llm target needs TensorRT-LLM with its PyTorch backend "
                          f"({TENSORRT_LLM_INSTALL_HINT}): {error}") from error
    check_tensorrt_llm_version(tensorrt_llm.__version__)
    drafter = importlib.import_module(DRAFTER_MODULE)  # subclasses TensorRT-LLM's Drafter
    drafter_form(drafter.Drafter)
    return TensorRTLLMApi(tensorrt_llm.__version__, LLM, LlmSamplingParams, KvCacheConfig,
                          UserProvidedDecodingConfig, drafter.TensorRTLLMDrafter)
