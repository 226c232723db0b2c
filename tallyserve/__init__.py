"""tallyserve: an LLM inference engine whose token tally is exact."""

from tallyserve.config import EngineArgs
from tallyserve.outputs import CompletionOutput, RequestOutput
from tallyserve.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model code: import it lazily so `import tallyserve` stays light.
    if name == "LLM":
        from tallyserve.engine.llm import LLM

        return LLM
    if name in ("BeamSearchParams", "BeamSearchOutput"):
        from tallyserve.engine import beam_search

        return getattr(beam_search, name)
    raise AttributeError(f"module 'tallyserve' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "BeamSearchParams", "BeamSearchOutput", "RequestOutput",
           "CompletionOutput", "EngineArgs", "__version__"]
