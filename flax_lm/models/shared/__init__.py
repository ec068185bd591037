"""What several model families compute alike, once: common.py (attention, rotary positions, RMSNorm, the gated MLP,
the decoder stack around the layers, the mapping onto the Hugging Face checkpoint layout), moe.py (the
mixture-of-experts layer: routing, dropless experts, the auxiliary losses), moe_decoder.py (the decoder of the
mixture-of-experts families), layer_norm_decoder.py (what the LayerNorm decoders, GPT-J, GPT-NeoX and OPT, build their
stacks from) and hf_state_dict.py (the mapping onto a checkpoint by a family's own tensor names). A family's
model.py imports from here, and its code fingerprint covers the files of this folder it builds on
(flax_lm/models/model_code.py)."""
