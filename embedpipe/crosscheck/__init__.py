"""``embedpipe crosscheck``: the steps (``run``), the fp32 re-run (``reference``), the
comparisons (``compare``) by the registered ``measures``, the verdict (``verdict``), the user's labels (``labels``,
``downstream``), numpy ``metrics``, number ``formatting`` and the HTML page (``report/``)."""
