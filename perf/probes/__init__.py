"""One-off measurements, kept because a default or a doc's figure rests on them; each docstring's first line says
what question it answered."""
