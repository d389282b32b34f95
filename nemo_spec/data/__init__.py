"""Training data: chat/text readers and writers, chat templates, tokenisation with loss masks, the DataModule.

Public API::

    read_conversations(path, fmt="auto", strict=False) -> [{"id", "system", "turns": [{"role", "content"}]}]
    write_daring_anteater(records, path)   # atomic JSONL
    load_tokenizer(path); render_chat(tok, messages, add_generation_prompt); apply_chat_template(tok, messages)
    encode_chat(tok, record, max_len, loss_on="assistant") -> Encoded(input_ids, loss_mask, truncated)
    SpecDataModule(DataConfig(...), tokenizer, micro_batch_size)
"""
from nemo_spec.data.chat import (DEFAULT_CHAT_TEMPLATE, ChatTemplateError, Encoded, apply_chat_template,
                                 chat_template_of, encode_chat, encode_text, load_tokenizer, record_messages,
                                 render_chat)
from nemo_spec.data.datamodule import (DataConfig, DataParallelBatchSampler, DataStats, SpecDataModule, TokenDataset,
                                       collate, encode_records, split_indices)
from nemo_spec.data.formats import (FORMATS, DataFormatError, EmptyDatasetError, ReadStats, detect_format,
                                    parse_record, read_conversations, to_daring_anteater, write_daring_anteater,
                                    write_messages)

__all__ = [
    "DEFAULT_CHAT_TEMPLATE", "ChatTemplateError", "Encoded", "apply_chat_template", "chat_template_of", "encode_chat",
    "encode_text", "load_tokenizer", "record_messages", "render_chat", "DataConfig", "DataParallelBatchSampler",
    "DataStats", "SpecDataModule", "TokenDataset", "collate", "encode_records", "split_indices", "FORMATS",
    "DataFormatError", "EmptyDatasetError", "ReadStats", "detect_format", "parse_record", "read_conversations",
    "to_daring_anteater", "write_daring_anteater", "write_messages",
]
