"""Test helpers: tiny random models (tiny), in-process meshes (meshkit), the real models and their
reference cases (realmodels), Hugging Face reference families (hf_families), and helpers shared by
several test modules (api, batching, hostile, lying)."""
