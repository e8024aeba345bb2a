"""``embedpipe crosscheck``: the steps (``run``), the comparisons (``compare``), the verdict
(``verdict``), the user's labels (``labels``, ``downstream``), numpy ``metrics``, number
``formatting`` and the HTML page (``report/``)."""
