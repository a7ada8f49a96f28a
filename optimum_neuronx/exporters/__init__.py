from .registry import get_export_config, supported_model_types

__all__ = ["get_export_config", "supported_model_types"]
