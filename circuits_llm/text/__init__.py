"""Models and their text: what ``--model`` names (:mod:`~circuits_llm.text.references`), the one
model loader (:mod:`~circuits_llm.text.models`), tokenizers (:mod:`~circuits_llm.text.tokens`),
tokenised corpora cached on disk (:mod:`~circuits_llm.text.corpus`) and the byte level with its
splits (:mod:`~circuits_llm.text.byte_level`). Inside the room the order is
byte_level, references -> tokens -> models, corpus; nothing points back."""
