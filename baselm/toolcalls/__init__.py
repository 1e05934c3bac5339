"""Tool calls: which format a chat template teaches its model (markers.py holds the table of
formats), reading calls out of an answer whole and streamed (parsers.py, over one reader per
format in formats.py and blocks.py), and forcing a call by grammar (forcing.py, built on
baselm/structured; it also makes every constrained answer's processors). A request's tools that
cannot be served raise `errors.ToolCallError`."""
