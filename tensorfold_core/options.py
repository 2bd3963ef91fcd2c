"""One table of serve options: it feeds click, the server, `capabilities --json` and the docs' flag list."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

DEFAULT_CONTEXT_CAP = 8192  # the context a model is served with when --context is not given, at most


class ServeOptions(BaseModel):
    """Flags of `tensorfold serve` (and the model-facing ones of `tensorfold run`)."""

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on (0 picks a free one).")
    parallel: int = Field(4, ge=1, le=64, description="Most streams decoded together in one round.")
    context: int | None = Field(None, ge=16, description="Most tokens a stream may hold, prompt and reply "
                                "(default: the model's max_position_embeddings, at most "
                                f"{DEFAULT_CONTEXT_CAP}).")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="Float dtype of the weights and activations (auto: the checkpoint's).")
    prefill_chunk: int = Field(256, ge=1, le=8192, description="Prompt tokens a stream prefills per round.")
    drafter: str | None = Field(None, description="A smaller same-tokenizer model that proposes drafts (a dir, "
                                "a shipped name or a hub id; 'none' serves without one; default: the shipped "
                                "model's own drafter).")
    drafter_bits: Literal[0, 4, 8] | None = Field(None, description="Width the drafter checkpoint must hold: 4 "
                                                  "or 8 (MLX affine, read in place) or 0 (float); default: "
                                                  "whatever it holds. Drafters are not quantized at load: a "
                                                  "width the checkpoint does not hold is refused, naming it.")
    memory_gib: float | None = Field(None, gt=0, description="The one byte budget for stream caches, drafter "
                                     "slots and kept prompt states (default: half the machine's memory).")
    prompt_cache_gib: float = Field(1.0, ge=0, description="Most bytes kept prompt states may hold (0 turns "
                                    "the prompt cache off).")
    model_name: str | None = Field(None, description="Name the model is served under in /v1/models.")
    max_queued: int = Field(64, ge=0, description="Most requests waiting for a stream slot; past it a request is "
                            "refused at once with a 429 and a Retry-After header.")
    deadline_s: float | None = Field(None, gt=0, description="Seconds a request may run, queue included; a reply "
                                     "still running then ends as max_tokens would end it (finish_reason "
                                     "\"length\"). Default: no deadline.")
    max_body_mib: float = Field(4.0, gt=0, description="Largest request body in MiB; a larger one is refused with "
                                "a 413 before it is read.")
    read_timeout_s: float = Field(10.0, gt=0, description="Seconds a client may take to send a request's headers, "
                                  "and each piece of its body; a slower connection is closed.")
    keep_alive_s: float = Field(5.0, gt=0, description="Seconds an idle keep-alive connection stays open.")
    grace_s: float = Field(30.0, ge=0, description="On SIGTERM: seconds running requests may take to finish while "
                           "new ones get a 503; those still running then end with an error event.")
    api_key: str | None = Field(None, exclude=True, description="Key every route but /health requires as "
                                "`Authorization: Bearer KEY` (default: the TENSORFOLD_API_KEY environment variable; "
                                "neither: no key).")
    allowed_hosts: str | None = Field(None, description="Comma-separated Host header names the server answers "
                                      "(against DNS rebinding; '*': any). Default: localhost and the loopback "
                                      "addresses when bound to loopback, any otherwise.")
    allowed_origins: str | None = Field(None, description="Comma-separated origins browsers may call the API "
                                        "from (CORS; '*': any). Default: none, CORS off.")
    plugin_options: dict = Field(default_factory=dict, exclude=True,
                                 description="Values of the plugins' own flags, by name (not a flag itself).")

    @classmethod
    def flag_fields(cls) -> dict:
        """The fields that are flags of `tensorfold serve`."""
        return {name: field for name, field in cls.model_fields.items() if name != "plugin_options"}

    @classmethod
    def flag(cls, field_name: str) -> str:
        return "--" + field_name.replace("_", "-")


def flags_markdown() -> str:
    """The docs' flag list, made from the same table click and capabilities read."""
    lines = ["| flag | default | what it sets |", "| --- | --- | --- |"]
    for name, field in ServeOptions.flag_fields().items():
        default = "" if field.default is None else f"`{field.default}`"
        lines.append(f"| `{ServeOptions.flag(name)}` | {default} | {field.description} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(flags_markdown(), end="")
