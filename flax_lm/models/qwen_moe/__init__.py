"""The qwen_moe family: its model module (model.py)."""
