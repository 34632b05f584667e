"""Encoded bytes to an RGB image, under `MediaLimits`.

The header is read first and the pixel count checked against the limit before any
pixel is decoded, so a small file that claims a huge canvas (a decompression bomb)
costs nothing. Decoder errors become a `MediaError` that names the part and says
what is wrong, never the decoder's own text."""

from __future__ import annotations

import io
import warnings

from ember.multimodal.limits import MediaError, MediaLimits

# what PIL may open: the common still-image formats (GIF and WebP also animate)
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")


def decode_image(data: bytes, limits: MediaLimits, where: str | None = None):
    """The first frame of the image in ``data``, in RGB (a ``PIL.Image.Image``)."""
    from PIL import Image

    if len(data) > limits.max_image_bytes:
        raise MediaError(f"image has {len(data)} bytes, more than the limit of {limits.max_image_bytes}", where, 413,
                         "max_image_bytes")
    if not data:
        raise MediaError("image is empty (0 bytes)", where)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise MediaError(f"image has more pixels than the limit of {limits.max_image_pixels}", where,
                             limit="max_image_pixels") from None
        except Exception:  # PIL raises many kinds for foreign or broken bytes; none is shown
            raise MediaError(f"not an image in a format Ember reads ({', '.join(IMAGE_FORMATS)})", where) from None
    limits.check_size(*image.size, where)
    try:
        if getattr(image, "n_frames", 1) > 1:
            image.seek(0)  # an animation: its first frame
        image.load()
        return image.convert("RGB")
    except Exception:
        raise MediaError(f"image data is truncated or corrupt ({image.format or 'unknown'} file)", where) from None
