"""An LLM inference engine: paged KV cache, continuous batching with chunked prefill, Llama/Qwen2.

`LLM` is the offline API; `LLMEngine` the step-level engine a server drives.
"""

from engine.config import EngineArgs, ModelConfig
from engine.engine import EngineStats, LLMEngine, RequestOutput
from engine.errors import InvalidRequestError
from engine.llm import LLM
from engine.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "EngineArgs",
    "EngineStats",
    "InvalidRequestError",
    "LLMEngine",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]
