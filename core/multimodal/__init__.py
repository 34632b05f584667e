"""Media in requests: what an image becomes on its way to the engine.

One room per duty (docs/multimodal.md):

* `inputs` — the plain values that travel with a request (`MultiModalItem`: one
  processed image, its content hash and where its placeholder tokens lie);
* `config` — a multimodal checkpoint's config seen as its language model's
  (`text_view`), so that everything sized from the text config stays as it is;
* `limits` — `MediaLimits` (items per prompt, bytes, pixels) and `MediaError`;
* `image` — bytes to a decoded image under those limits (pixel cap read from the
  header before any decoding);
* `fetch` — the one fetcher of remote and local URLs, with the security policy;
* `sources` — what a request names (a ``data:`` URL, ``http(s)://``, ``file://``,
  a PIL image) to an image, through `fetch` and `image`;
* `processor` — the model's Hugging Face image processor, Ember's placeholder
  expansion and the content hash.

Nothing here runs in the engine's step: requests are processed before they enter it.
"""
