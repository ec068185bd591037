"""The parts several model families share: the mixture-of-experts layer (moe.py) and its decoder (moe_decoder.py)."""
