"""MoonViT-V2 (the K3 vision tower), its projector and the multimodal model: docs/model.md §14."""
