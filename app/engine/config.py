"""Settings of one target engine (``TargetEngine``): a pydantic model without torch, so configuration can be read and
validated by processes that never run the engine (the HTTP ingress, config checks).

Owns: the engine's fields, their defaults and documentation, and the checks between them. Does not own: what the
fields do (``engine.py``, ``loader.py``).
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

# the largest max_draft_len: the target's rotary tables cover this many positions past its context (a KV slot holds
# max_draft_len positions past max_model_len, where the padding of a verify step's last rows lands)
MAX_DRAFT_LEN = 256

LoadFormat = Literal["auto", "dummy"]
LOAD_FORMATS: tuple[str, ...] = get_args(LoadFormat)
VerifyStep = Literal["ragged", "bucketed", "cuda_graphs"]
Attention = Literal["auto", "sdpa", "flash"]


def is_template_text(value: str) -> bool:
    """Whether ``value`` is a Jinja template's text rather than a file's path (vLLM's test: Jinja markup)."""
    return "{{" in value or "{%" in value


def check_chat_template(text: str) -> None:
    """Check a chat template's text as the renderer will compile it (Hugging Face's sandboxed Jinja), so a broken one
    fails at start, not in every chat request.

    Raises:
        ValueError: no Jinja markup (a file's path given as text), or a Jinja syntax error (its line and message).
    """
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    if not is_template_text(text):
        raise ValueError(f"chat_template {text[:80]!r} has no Jinja markup ('{{{{' or '{{%'): give the template's "
                         "text (the serving config reads it from a file's path)")
    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"chat_template does not compile: line {err.lineno}: {err.message}") from None


class EngineConfig(BaseModel):
    """Settings of one target engine (one target replica)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field("smollm2-135m", description="Target: embedded name, local dir, .gguf file or cached HF id.")
    load_format: LoadFormat = Field(
        "auto", description="auto: the checkpoint's weights; dummy: random weights on the checkpoint's config.json and "
        "tokenizer (no safetensors needed), for profiling step costs (vLLM's --load-format dummy).",
    )
    dtype: str = Field(
        "auto", description="Weights/activations dtype: auto (bfloat16 on a GPU or a CPU with bfloat16 kernels, "
        "float32 on other CPUs), bfloat16, float16, float32.",
    )
    device: str = Field("auto", description="auto (cuda if available, else cpu), cpu, cuda, cuda:N.")
    max_model_len: int = Field(2048, ge=16, description="Per-request context limit in tokens: prompt + max_tokens "
                               "(a KV slot holds max_draft_len positions more, for draft blocks).")
    max_num_seqs: int = Field(32, ge=1, description="Concurrent requests (KV cache slots).")
    max_draft_len: int = Field(8, ge=0, le=MAX_DRAFT_LEN,
                               description="Most draft tokens verified per request per step.")
    fp32_lm_head: bool = Field(
        True, description="Compute logits with a float32 copy of the LM head (stable greedy ties in bfloat16)."
    )
    greedy_screen: bool = Field(
        True, description="bfloat16/float16 model with the float32 LM head: greedy requests take the argmax of "
        "exact logits of the candidates a half-precision LM head screens out (app/engine/greedy_head.py), "
        "not a float32 matmul over the vocabulary.",
    )
    prepack: bool = Field(
        True, description="CPU with oneDNN: the decoder's linear layers (float32, or bfloat16 where oneDNN has "
        "bfloat16 kernels), the greedy screen and the float32 LM head run on weights prepacked once into oneDNN's "
        "blocked layout (app/engine/prepack.py): bfloat16 outputs bit-identical, float32 ones within rounding and "
        "the same for a row at any row count from two up; 1.2-2x faster matmuls at decode sizes. Ignored where "
        "unsupported.",
    )
    batch_invariant: bool = Field(
        False, description="A request's logits depend on its own tokens only, not on the other requests of the step "
        "nor on how many drafts it verifies: each request runs alone, padded to max_draft_len + 1 rows, attending over "
        "its whole KV slot, and is prefilled alone. Seeded requests then reproduce exactly, greedy ones are identical "
        "alone and in any batch. Costs one forward per request per step (docs/serving.md).",
    )
    enable_prefix_caching: bool | None = Field(
        None, description="A new prompt reuses the KV cache and drafter features of the longest prefix it shares with "
        "what a slot holds (a running request's prompt, or a finished one's prompt and answer until its slot is taken "
        "again: the next turn of a chat reuses both) and prefills only the rest (app/engine/prefix_cache.py; vLLM's "
        "--enable-prefix-caching). Costs the tokens' features kept beside the KV cache (F values per token). None: "
        "on, except with batch_invariant "
        "(a reused prefix was computed in another step's shape); true with batch_invariant is an error.",
    )
    verify_step: VerifyStep = Field(
        "ragged", description="ragged: each verify step in its exact shape, its layout built on the host. bucketed: "
        "static shapes (slots, tokens per request and key length each padded up to a bucket), the layout built on "
        "the device from the token grid and cache lengths (app/engine/static_step.py); padding changes no output. "
        "cuda_graphs: bucketed, every shape captured once as a CUDA graph at start-up and replayed (CUDA only). "
        "Prefill stays ragged. Not combined with batch_invariant.",
    )
    attention: Attention = Field(
        "auto", description="flash: a token-major KV cache; steps of one token per request attend by one call of "
        "FlashAttention-2's variable-length kernel (PyTorch's build; each request reads its own keys, no mask), longer "
        "runs by scaled_dot_product_attention over the grouped queries with a mask (CUDA, float16 or bfloat16). sdpa: "
        "scaled_dot_product_attention with a mask for every step. auto: flash where it runs and agrees with math "
        "attention on a probe at start-up, else sdpa (on CUDA the reason is logged); flash where it cannot run is an "
        "error at start-up.",
    )
    compile_elementwise: bool | None = Field(
        None, description="torch.compile the decoder's elementwise work (norms, rotary embedding, residual, SwiGLU "
        "gate) into fused Triton kernels (app/engine/model.py Elementwise; compiled in the first steps, or while CUDA "
        "graphs are captured: longer start-up). None: on a CUDA device Triton supports (compute capability 7.0 or "
        "above, the triton package installed), off elsewhere (on CUDA the reason is logged); true where it cannot run "
        "is an error at start-up. Lossless like any step shape: greedy speculation stays token-identical to plain "
        "decoding on the same engine.",
    )
    feature_layers: tuple[int, ...] | None = Field(
        None, description="Target layers (0-based) whose hidden states feed the drafter; default 5 spread over depth."
    )
    chat_template: str | None = Field(
        None, description="A Jinja chat template's text that replaces the tokenizer's own (vLLM's --chat-template; "
        "the serving config also takes a file's path). None: the tokenizer's.",
    )

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if self.max_draft_len >= self.max_model_len // 2:
            raise ValueError(f"max_draft_len {self.max_draft_len} leaves no room in max_model_len {self.max_model_len}")
        if self.batch_invariant and self.verify_step != "ragged":
            raise ValueError(f"batch_invariant runs each request alone in one fixed shape; verify_step "
                             f"{self.verify_step!r} needs verify_step 'ragged'")
        if self.batch_invariant and self.enable_prefix_caching:
            raise ValueError("enable_prefix_caching reuses keys/values computed in other steps' shapes; it cannot be "
                             "combined with batch_invariant")
        if self.chat_template is not None:
            check_chat_template(self.chat_template)
        return self

    @property
    def prefix_caching(self) -> bool:
        """``enable_prefix_caching`` resolved (None: on unless ``batch_invariant``)."""
        return not self.batch_invariant if self.enable_prefix_caching is None else self.enable_prefix_caching
