"""The cross-check's HTML page (``page``) and its inline SVG figures (``figures``)."""
