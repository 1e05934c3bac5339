"""Tool calls: which format a chat template teaches its model, reading calls out of an answer (whole
and streamed), and forcing a call by grammar."""
