"""Reading the job's input into prompt batches, before tokenization.

- ``source.open_input``: the one entry point; a ``.jsonl`` path is OpenAI Batch requests
  (``openai_batch``), anything else Parquet (``parquet``: a file, folder or glob, streamed).
- ``prompt_builder``: a row's prompt text when it is not one finished column: ``template``
  (``input.template`` over columns) and ``chat_template`` (messages through the model's Jinja
  chat template, as ``transformers`` renders it).
- ``row_settings``: optional per-row columns that override ``[sampling]`` for one row.

Bad rows are rejected one by one with a status (``batchjob.status``); the job goes on.
"""
