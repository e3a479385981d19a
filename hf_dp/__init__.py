"""hf_dp: differentially private fine-tuning for the Hugging Face ecosystem.

Public API: everything a user needs is importable from here.
"""
