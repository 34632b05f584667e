"""Request and response schemas (pydantic): validation and the OpenAPI document."""
