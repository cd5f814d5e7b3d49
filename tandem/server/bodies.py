"""The JSON bodies of the HTTP server's routes, as pydantic models with SGLang's field names.

Each model refuses unknown fields (a typo must not be silently ignored) and takes JSON types strictly; a field's
`description` is its rule, quoted by the 400 that refuses it.
"""

from __future__ import annotations

from typing import Literal, Self

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tandem.config import PauseMode


class _Body(BaseModel):
    """A JSON object body: unknown fields refused (a typo must not be silently ignored), JSON types strict (no "1"
    for 1, no null where none is declared, no NaN). A field's `description` is its rule: a 400 for it quotes it."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    @classmethod
    async def from_request(cls, request: Request) -> Self:
        """FastAPI dependency: the request's body validated (in one pass over the raw JSON, whatever its
        content type); ValueError naming each field that is wrong."""
        raw = await request.body()
        try:
            return cls.model_validate_json(raw if raw.strip() else b"{}")
        except ValidationError as e:
            raise ValueError(cls._explain(e)) from None

    @classmethod
    def _explain(cls, error: ValidationError) -> str:
        """`field: rule, got value` for each field that is wrong, its rule the field's description or pydantic's."""
        found: dict[str, str] = {}
        for e in error.errors(include_url=False):
            name = e["loc"][0] if e["loc"] else "request body"
            info = cls.model_fields.get(name)
            if e["type"] == "json_invalid":
                why = f"malformed JSON ({e['ctx']['error']})"
            elif not e["loc"]:
                why = f"must be a JSON object, got {type(e['input']).__name__}"
            elif info is None:
                why = f"unknown field; this endpoint accepts {sorted(cls.model_fields)}"
            elif e["type"] == "missing":
                why = "required" + (f" ({info.description})" if info.description else "")
            else:
                why = info.description or e["msg"].replace("Input should be", "must be")
                why += f", got {e['input']!r}" if len(e["loc"]) == 1 else ""
            found.setdefault(name, f"{name}: {why}")
        return "; ".join(found.values())


_NONE = "tandem has no {what}; send null"


class GenerateBody(_Body):
    """SGLang's `/generate` (`GenerateReqInput`): the prompt as `input_ids`, or as `text` when the model directory
    has a tokenizer; a list of prompts is a batch. Every field SGLang documents that RL clients send is known; null
    means the default, as in SGLang. Fields of features tandem lacks (images, LoRA, hidden states...) are accepted
    only null or false. The prompts, rids and sampling params themselves are checked by `Engine.validate` and
    `SamplingParams.from_dict`, as for callers in process."""

    text: str | list[str] | None = Field(
        None, description="must be a string, or a batch: a list of strings (a model directory's tokenizer encodes "
        "them)")
    input_ids: list | None = Field(
        None, description="must be a non-empty list of token ids, or a batch: a list of such lists")
    sampling_params: dict | list[dict] | None = Field(
        None, description="must be an object (a batch: one, or a list of one per request)")
    rid: str | list[str] | None = Field(
        None, description="must be a non-empty string (a batch: a list of one per request)")
    return_logprob: bool | list[bool] | None = Field(
        None, description="must be true or false (a batch: one, or a list of one per request)")
    return_text_in_logprobs: bool | None = None  # the logprobs' texts: each token decoded (null without a tokenizer)
    top_logprobs_num: int | None = Field(
        None, ge=0, description="must be a non-negative integer: the most likely tokens returned per output token")
    stream: bool | None = None  # server-sent events, SGLang's chunks (see `tandem.server.http`)
    logprob_start_len: Literal[-1] | None = Field(
        None, description="only -1 (logprobs of the output tokens) is supported")
    return_routed_experts: bool | list[bool] | None = Field(
        None, description="must be true or false (a batch: one, or a list of one per request)")
    routed_experts_start_len: Literal[0] | None = Field(
        None, description="only 0 (the routing of every token) is supported")
    # accepted and ignored: tandem's prefix cache holds one namespace (KV of the same tokens and weights is the
    # same), and it has no priorities or metrics per request
    extra_key: str | list[str] | None = None
    cache_salt: str | list[str] | None = None
    priority: int | None = None
    log_metrics: bool | None = None
    session_id: str | None = None
    conversation_id: str | None = None
    routing_key: str | None = None
    custom_labels: dict | None = None
    # SGLang's features tandem lacks: only null or false
    return_indexer_topk: Literal[False] | None = Field(
        None, description="the model has no sparse-attention indexer; send false or null")
    return_sampling_mask: Literal[False] | None = Field(
        None, description="sampling masks are not returned; send false or null")
    return_hidden_states: Literal[False] | None = Field(
        None, description="hidden states are not returned; send false or null")
    return_entropy: Literal[False] | None = Field(None, description="entropy is not returned; send false or null")
    token_ids_logprob: None = Field(None, description="logprobs of chosen token ids are not supported; send null")
    input_embeds: None = Field(None, description="embeddings as input are not supported; send input_ids")
    image_data: None = Field(None, description=_NONE.format(what="multimodal input"))
    video_data: None = Field(None, description=_NONE.format(what="multimodal input"))
    audio_data: None = Field(None, description=_NONE.format(what="multimodal input"))
    modalities: None = Field(None, description=_NONE.format(what="multimodal input"))
    lora_path: None = Field(None, description=_NONE.format(what="LoRA adapters"))
    lora_id: None = Field(None, description=_NONE.format(what="LoRA adapters"))
    custom_logit_processor: None = Field(None, description=_NONE.format(what="custom logit processors"))
    session_params: None = Field(None, description=_NONE.format(what="SGLang sessions"))
    bootstrap_host: None = Field(None, description="tandem's decode servers take bootstrap (a router adds it)")
    bootstrap_port: None = Field(None, description="tandem's decode servers take bootstrap (a router adds it)")
    bootstrap_room: None = Field(None, description="tandem's decode servers take bootstrap (a router adds it)")
    data_parallel_rank: None = Field(None, description=_NONE.format(what="data-parallel ranks"))
    routed_dp_rank: None = Field(None, description=_NONE.format(what="data-parallel ranks"))
    bootstrap: Bootstrap | None = Field(
        None, description="on a decode server: an object naming the prefill server, {\"prefill_url\": URL}")


class Bootstrap(_Body):
    """Where a decode server's prompts are computed (a router adds it; see `tandem.server.disagg`)."""

    prefill_url: str = Field(description="must be the base URL of a prefill server")


class PrefillBody(_Body):
    """A decode server's request to a prefill server (`tandem.server.disagg`)."""

    rid: str = Field(description="must be the decode server's request id")
    input_ids: list[int] = Field(description="must be the prompt's token ids")
    sampling_params: dict = Field(description="must be the request's sampling params, its seed set")
    kv_from: int = Field(ge=0, description="must be the page-aligned position from which to send the KV")
    prompt_len: int | None = Field(None, ge=1, description="must be the prompt's length within input_ids (the "
                                   "rest generated before: a request handed back)")
    transfer: Literal["bytes", "reference", "p2p"] = Field(
        "bytes", description="must be \"bytes\" (the KV in the answer's body), \"reference\" (a handle to the KV, "
        "which the prefill server holds until released: servers of one host) or \"p2p\" (its header; the KV is "
        "held until sent over `link`)")
    link: str | None = Field(None, description="with transfer \"p2p\": must be the id of a link /pd/p2p/open made")


class ReleaseBody(_Body):
    """A decode server's word that it took the KV a prefill server holds for it (`tandem.server.disagg`)."""

    id: str = Field(min_length=1, description="must be the id of a KV export this server answered with")


class P2PSendBody(_Body):
    """A decode server's word that it receives, over a link, the KV a prefill server holds for it
    (`tandem.server.disagg`)."""

    id: str = Field(min_length=1, description="must be the id of a KV export this server answered with")
    link: str = Field(min_length=1, description="must be the id of the link the export is for")


class PauseBody(_Body):
    mode: PauseMode = "abort"  # SGLang's default


class NoBody(_Body):
    pass


class AbortBody(_Body):
    rid: str = ""
    abort_all: bool = False


class DiskUpdateBody(_Body):
    model_path: str = Field(min_length=1, description="must be a directory holding *.safetensors files")
    weight_version: int | None = None


class InitGroupBody(_Body):
    master_address: str = Field(min_length=1, description="must be the trainer's host name or address")
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"  # gloo or nccl (checked by DistReceiver)
    timeout_s: float = Field(60.0, gt=0)  # tandem's: bounds joining and every later collective


_IN_BAND = "tandem's sender puts each bucket's names, dtypes and shapes in the group; omit them"


class GroupUpdateBody(_Body):
    group_name: str = "weight_update_group"
    weight_version: int | None = None
    pause_mode: PauseMode = "retract"
    flush_cache: Literal[True] = Field(True, description="the engine's prefix_cache_max_age decides which updates "
                                                         "empty the prefix cache; omit it or send true")
    names: None = Field(None, description=_IN_BAND)  # SGLang sends these per call
    dtypes: None = Field(None, description=_IN_BAND)
    shapes: None = Field(None, description=_IN_BAND)


class GroupBody(_Body):
    group_name: str = "weight_update_group"
