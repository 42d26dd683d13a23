"""Model families: each a module of pure functions over a params pytree, found by the registry.

registry.py    the `Family` record, the registry (HF model_type / GGUF architecture ->
               family) and the family-agnostic face everyone else uses: config readers,
               param shapes and axes, params <-> flat names, forward, logits
fusion.py      q/k/v and gate/up fused into one matrix each at load (and split again for
               the checkpoint), and the model's split of their products
layers.py      shared blocks: RMSNorm (incl. Gemma's 1 + w), rotary (per-layer bases, rope
               scaling, GGUF rope factors), gated MLP (SiLU / tanh-GELU), soft-cap, the
               per-layer AttentionSpec and the paged-attention call
llama.py       Llama 2/3.x, Mistral, Qwen2/2.5, SmolLM2 (and the decoder Qwen3 reuses)
qwen3.py       Qwen3
gemma.py       Gemma 2, Gemma 3 text (and a multimodal Gemma 3's language model)
moe.py         the mixture-of-experts feed-forward (routing, grouped expert products)
mixtral.py     Mixtral (llama decoder, every layer MoE)
qwen3_moe.py   Qwen3-MoE (qwen3 decoder, MoE or dense per layer)

Nothing outside this package imports a family module; runner, step, model, sharding,
checkpoint and checkpoints_tools call `registry`.

Adding a family
---------------
One new module in this package; qwen3.py is the example. The registry finds it by its
module-level `FAMILY = registry.Family(...)`, which declares:

1. `architectures` / `gguf_architectures`: the HF `model_type` values (with their
   architecture classes) and GGUF `general.architecture` values it serves; `gguf_claims`
   when it reads files written under another family's architecture (mixtral.py: a `llama`
   GGUF with experts).
2. `config_from_hf(hf_dict)` and `config_from_gguf(metadata, tensor_names, dtype,
   read_tensor)`: read the fields the family uses into a `ModelConfig` (the shared ones via
   `config.hf_common_fields` / `gguf_common_fields`), and raise ValueError naming any field
   whose value the family does not implement. Qwen3 adds `qk_norm=True`, its biases and
   Qwen's sliding-window fields. Per-layer choices are tuples (`layer_types`), so the config
   stays hashable and each layer's attention is static.
3. `param_shapes(cfg)`: flat name -> shape, layers stacked on a first L axis ("layers.q_norm":
   (L, H) for Qwen3); `param_axes`: flat name -> logical axes for sharding.py.
4. Name maps: `hf_top` / `hf_layer` (HF name -> flat name), `gguf_top` / `gguf_layer`
   (llama.cpp name -> HF name), and when the files differ from transformers' values,
   `hf_rename` (e.g. a multimodal checkpoint's prefixes) and `from_gguf` (what llama.cpp's
   converter changed: permuted Q/K rows for `llama`, +1 folded into Gemma norms).
5. `forward(params, cfg, kv, inputs, backend)` -> (final hidden f32[T, D], kv) and
   `logits(params, cfg, hidden)` -> f32[R, V], built from layers.py. Qwen3 reuses llama.py's
   decoder, which applies the q/k norms when `cfg.qk_norm`; a family with a different layer
   (gemma.py) writes its own loop over `registry.layer_params(params)` and calls
   `layers.paged_attention` once per layer, which writes the layer's K/V and attends with the
   layer's `AttentionSpec` (scale, sliding window, soft-cap). Where the logits are the LM
   head's product and nothing more, `lm_head(params)` names that weight: on CPU greedy
   decoding then takes its argmax inside the product's call (`registry.logits_or_argmax`).

Then add its cases to tests/family_models.py: tests/test_families.py checks the logits against
transformers, the declarations against each other and the config round trip.
"""
