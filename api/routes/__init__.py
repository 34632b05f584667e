"""HTTP routes: TGI's, OpenAI's, and the common ones (health, info, models, docs)."""
