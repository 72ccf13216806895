//! Text in and out of the model: the tokenizer (from `tokenizer.json` or
//! built from GGUF metadata), the chat template (rendered with minijinja, with
//! the helpers Hugging Face templates call) and end-of-sequence ids.

use std::path::Path;
use std::str::FromStr;

use minijinja::{Environment, Error as TemplateError, ErrorKind, context};
use serde_json::{Value, json};
use tokenizers::Tokenizer;

use super::api::ChatMessage;
use super::model::{GgufMetadata, LoadError};

/// Everything text-related a model needs.
pub struct TextCodec {
    tokenizer: Tokenizer,
    chat_template: Option<String>,
    /// The chat template compiled once, on first use.
    chat_env: std::sync::OnceLock<Result<Environment<'static>, String>>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    bos_id: Option<u32>,
    /// Prepend BOS to prompts that lack it.
    add_bos: bool,
    /// Any of these ends generation.
    pub eos_ids: Vec<u32>,
}

impl TextCodec {
    /// From `tokenizer.json` + `tokenizer_config.json` (+ `generation_config.json`) in `dir`.
    pub fn from_hf_dir(dir: &Path, config_eos: &[u32]) -> Result<TextCodec, LoadError> {
        let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json")).map_err(|e| {
            LoadError::Tokenizer(format!("{}: {e}", dir.join("tokenizer.json").display()))
        })?;
        let read_json = |name: &str| -> Value {
            std::fs::read_to_string(dir.join(name))
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok())
                .unwrap_or(Value::Null)
        };
        let config = read_json("tokenizer_config.json");
        let token_text = |key: &str| match config.get(key) {
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).map(str::to_owned),
            _ => None,
        };
        let (bos_token, eos_token) = (token_text("bos_token"), token_text("eos_token"));
        let mut eos_ids: Vec<u32> = config_eos.to_vec();
        eos_ids.extend(eos_token.as_deref().and_then(|t| tokenizer.token_to_id(t)));
        eos_ids.extend(ids_of(&read_json("generation_config.json")["eos_token_id"]));
        let chat_template = match config.get("chat_template") {
            Some(Value::String(t)) => Some(t.clone()),
            // Newer files hold a list of named templates; "default" is the chat one.
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t["name"] == "default")
                .or(list.first())
                .and_then(|t| t["template"].as_str())
                .map(str::to_owned),
            _ => std::fs::read_to_string(dir.join("chat_template.jinja")).ok(),
        };
        Ok(TextCodec::assemble(TextCodec {
            chat_env: std::sync::OnceLock::new(),
            bos_id: bos_token.as_deref().and_then(|t| tokenizer.token_to_id(t)),
            add_bos: config
                .get("add_bos_token")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            tokenizer,
            chat_template,
            bos_token,
            eos_token,
            eos_ids,
        }))
    }

    /// From a GGUF file's `tokenizer.ggml.*` metadata, read through MLX's
    /// loader or our own reader: byte-level BPE (`gpt2`: vocab + merges) or
    /// SentencePiece BPE (`llama`: vocab + scores, e.g. Gemma).
    pub fn from_gguf(file: &(impl GgufMetadata + ?Sized)) -> Result<TextCodec, LoadError> {
        let model = file
            .meta_string("tokenizer.ggml.model")?
            .unwrap_or_default();
        let tokens = file
            .meta_strings("tokenizer.ggml.tokens")?
            .unwrap_or_default();
        let types: Vec<i32> = file
            .meta_numbers("tokenizer.ggml.token_type")?
            .unwrap_or_default()
            .into_iter()
            .map(|t| t as i32)
            .collect();
        let json = match model.as_str() {
            "gpt2" => {
                let merges = file
                    .meta_strings("tokenizer.ggml.merges")?
                    .unwrap_or_default();
                let pre = file.meta_string("tokenizer.ggml.pre")?.unwrap_or_default();
                bpe_tokenizer_json(&tokens, &merges, &types, &pre)
            }
            "llama" => {
                let scores = file.meta_numbers("tokenizer.ggml.scores")?.ok_or_else(|| {
                    LoadError::Tokenizer(
                        "SentencePiece GGUF without `tokenizer.ggml.scores`".into(),
                    )
                })?;
                let space_prefix = file
                    .meta_number("tokenizer.ggml.add_space_prefix")?
                    .is_none_or(|flag| flag != 0.0);
                spm_tokenizer_json(&tokens, &scores, &types, space_prefix)
            }
            other => {
                return Err(LoadError::Tokenizer(format!(
                    "GGUF tokenizer model `{other}` is not supported (`gpt2` and `llama` are); put a tokenizer.json next to the model"
                )));
            }
        };
        let tokenizer = Tokenizer::from_str(&json.to_string())
            .map_err(|e| LoadError::Tokenizer(e.to_string()))?;
        TextCodec::with_gguf_specials(tokenizer, file)
    }

    /// From the `tokenizer.json` next to a GGUF file (`<stem>.tokenizer.json`,
    /// else `tokenizer.json` in its folder) when there is one, for tokenizers
    /// GGUF metadata cannot express exactly (SentencePiece models such as
    /// Gemma's); else from the GGUF metadata. Special ids, BOS policy and the
    /// chat template come from the GGUF either way.
    pub fn for_gguf_file(
        path: &Path,
        file: &(impl GgufMetadata + ?Sized),
    ) -> Result<TextCodec, LoadError> {
        let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned());
        let beside = stem.map(|stem| path.with_file_name(format!("{stem}.tokenizer.json")));
        let shared = path.with_file_name("tokenizer.json");
        let Some(json) = beside.into_iter().chain([shared]).find(|p| p.is_file()) else {
            return TextCodec::from_gguf(file);
        };
        let tokenizer = Tokenizer::from_file(&json)
            .map_err(|e| LoadError::Tokenizer(format!("{}: {e}", json.display())))?;
        TextCodec::with_gguf_specials(tokenizer, file)
    }

    /// BOS / EOS ids, the add-BOS flag and the chat template from GGUF metadata.
    fn with_gguf_specials(
        tokenizer: Tokenizer,
        file: &(impl GgufMetadata + ?Sized),
    ) -> Result<TextCodec, LoadError> {
        let id = |key: &str| -> Result<Option<u32>, LoadError> {
            Ok(file.meta_number(key)?.map(|v| v as u32))
        };
        let (bos_id, eos_id) = (
            id("tokenizer.ggml.bos_token_id")?,
            id("tokenizer.ggml.eos_token_id")?,
        );
        let add_bos = file
            .meta_number("tokenizer.ggml.add_bos_token")?
            .is_some_and(|flag| flag != 0.0);
        let text_of = |id: Option<u32>| id.and_then(|id| tokenizer.id_to_token(id));
        Ok(TextCodec::assemble(TextCodec {
            chat_env: std::sync::OnceLock::new(),
            bos_token: text_of(bos_id),
            eos_token: text_of(eos_id),
            chat_template: file.meta_string("tokenizer.chat_template")?,
            tokenizer,
            bos_id,
            add_bos,
            eos_ids: eos_id.into_iter().collect(),
        }))
    }

    /// Adds the end-of-turn tokens chat models stop on, deduplicated.
    fn assemble(mut codec: TextCodec) -> TextCodec {
        for marker in [
            "<|im_end|>",
            "<|endoftext|>",
            "<|eot_id|>",
            "<end_of_turn>",
            "<eos>",
        ] {
            if let Some(id) = codec.tokenizer.token_to_id(marker) {
                codec.eos_ids.push(id);
            }
        }
        codec.eos_ids.sort_unstable();
        codec.eos_ids.dedup();
        codec
    }

    /// Writes `tokenizer.json` and `tokenizer_config.json` (with the chat
    /// template) into `dir`, as Hugging Face tooling expects them.
    pub fn save(&self, dir: &Path) -> Result<(), String> {
        let mut tokenizer: Value =
            serde_json::from_str(&self.tokenizer.to_string(false).map_err(|e| e.to_string())?)
                .map_err(|e| e.to_string())?;
        // Hugging Face tokenizers add BOS through the post-processor (Gemma
        // needs it); ours prepends it in `encode` instead.
        if let (true, Some(bos), Some(id)) = (self.add_bos, &self.bos_token, self.bos_id) {
            let special = json!({"SpecialToken": {"id": bos, "type_id": 0}});
            tokenizer["post_processor"] = json!({
                "type": "TemplateProcessing",
                "single": [special, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [special, {"Sequence": {"id": "A", "type_id": 0}},
                         special, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bos.as_str(): {"id": bos, "ids": [id], "tokens": [bos]}},
            });
        }
        std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string())
            .map_err(|e| e.to_string())?;
        let config = json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.add_bos,
            "chat_template": self.chat_template,
        });
        let text = serde_json::to_string_pretty(&config).map_err(|e| e.to_string())?;
        std::fs::write(dir.join("tokenizer_config.json"), text).map_err(|e| e.to_string())
    }

    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// Bytes of the longest vocabulary entry as written in the vocabulary
    /// (byte-level and SentencePiece spellings are never shorter than the
    /// text they stand for), so no token covers more text than this.
    pub fn longest_token_bytes(&self) -> usize {
        self.tokenizer
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(0)
    }

    /// Token ids for a prompt (special tokens written in the text are honoured).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        let encoding = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| e.to_string())?;
        let mut ids = encoding.get_ids().to_vec();
        if let Some(bos) = self.bos_id.filter(|_| self.add_bos)
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        Ok(ids)
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, true).unwrap_or_default()
    }

    /// Text of one token as the vocabulary spells it (for logprobs).
    pub fn token_text(&self, id: u32) -> String {
        self.tokenizer.decode(&[id], false).unwrap_or_default()
    }

    /// Renders the chat template with a generation prompt appended.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, String> {
        self.render_chat_with(messages, true)
    }

    /// Renders `messages`; without the generation prompt (the assistant
    /// turn's opening) when `add_generation_prompt` is false.
    pub fn render_chat_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let template = self
            .chat_template
            .as_deref()
            .ok_or("this model has no chat template; use /v1/completions")?;
        let env = self
            .chat_env
            .get_or_init(|| chat_environment(template.to_owned()))
            .as_ref()
            .map_err(Clone::clone)?;
        let template = env.get_template("chat").map_err(|e| e.to_string())?;
        let rendered = template
            .render(
                context! {
                    messages => messages.iter().map(|m| context! { role => m.role.clone(), content => m.content.clone() }).collect::<Vec<_>>(),
                    add_generation_prompt => add_generation_prompt,
                    bos_token => self.bos_token.clone().unwrap_or_default(),
                    eos_token => self.eos_token.clone().unwrap_or_default(),
                    tools => minijinja::Value::from(()),
                },
            )
            .map_err(|e| match e.detail() {
                Some(detail) => detail.to_owned(),
                None => e.to_string(),
            })?;
        Ok(rendered)
    }
}

/// A minijinja environment holding `template` as "chat", with the settings
/// and helper functions Hugging Face chat templates expect.
fn chat_environment(template: String) -> Result<Environment<'static>, String> {
    let mut env = Environment::new();
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    // Hugging Face renders chat templates with both of these on.
    if let Ok(syntax) = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
    {
        env.set_syntax(syntax);
    }
    env.add_function(
        "raise_exception",
        |message: String| -> Result<String, TemplateError> {
            Err(TemplateError::new(ErrorKind::InvalidOperation, message))
        },
    );
    env.add_function("strftime_now", |format: String| strftime_now(&format));
    env.add_template_owned("chat", template)
        .map_err(|e| format!("chat template does not parse: {e}"))?;
    Ok(env)
}

/// A few templates print today's date; plain UTC formatting of the common codes.
fn strftime_now(format: &str) -> String {
    let days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400) as i64;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    format
        .replace("%Y", &year.to_string())
        .replace("%m", &format!("{month:02}"))
        .replace("%d", &format!("{day:02}"))
        .replace("%B", MONTHS[(month - 1) as usize])
        .replace("%b", &MONTHS[(month - 1) as usize][..3])
}

fn ids_of(value: &Value) -> Vec<u32> {
    match value {
        Value::Number(n) => n.as_u64().map(|v| v as u32).into_iter().collect(),
        Value::Array(list) => list
            .iter()
            .filter_map(Value::as_u64)
            .map(|v| v as u32)
            .collect(),
        _ => Vec::new(),
    }
}

/// Qwen2's pre-tokenizer split (as published in its tokenizer.json).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Control (3) and user-defined (4) tokens of a GGUF vocabulary, matched
/// whole before the model runs, as `added_tokens` entries.
fn added_tokens(tokens: &[String], types: &[i32]) -> Vec<Value> {
    types
        .iter()
        .zip(tokens)
        .enumerate()
        .filter(|(_, (kind, _))| matches!(kind, 3 | 4))
        .map(|(id, (kind, token))| {
            json!({"id": id, "content": token, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": *kind == 3})
        })
        .collect()
}

/// A `tokenizer.json` for a SentencePiece BPE vocabulary from GGUF metadata
/// (`tokenizer.ggml.model = llama`), which has scores but no merges.
///
/// SentencePiece BPE merges the adjacent pair whose union is the
/// highest-scoring vocabulary piece, so the merge list is derived from the
/// vocabulary: every split of a piece into two pieces that are themselves in
/// the vocabulary is a merge, ranked by the score of the piece it makes. Bytes
/// outside the vocabulary fall back to `<0xNN>` tokens. Spaces become `▁`;
/// `space_prefix` adds one before the text (llama) or not (Gemma).
fn spm_tokenizer_json(
    tokens: &[String],
    scores: &[f64],
    types: &[i32],
    space_prefix: bool,
) -> Value {
    let ids: std::collections::HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.as_str(), id))
        .collect();
    let mut ranked: Vec<(f64, usize, usize, usize)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        // Byte and unused/control pieces are never produced by merging.
        if matches!(types.get(id), Some(3 | 6)) {
            continue;
        }
        let score = scores.get(id).copied().unwrap_or(0.0);
        for (split, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(split);
            if let (Some(&l), Some(&r)) = (ids.get(left), ids.get(right)) {
                ranked.push((score, id, l, r));
            }
        }
    }
    ranked.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then((a.1, a.2, a.3).cmp(&(b.1, b.2, b.3)))
    });
    let merges: Vec<Value> = ranked
        .iter()
        .map(|&(_, _, l, r)| json!([tokens[l], tokens[r]]))
        .collect();
    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(id, token)| (token.clone(), json!(id)))
        .collect();
    let replace = json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"});
    let (normalizer, decoder) = if space_prefix {
        (
            json!({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u{2581}"}, replace]}),
            json!({"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}),
        )
    } else {
        (
            replace,
            json!({"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}]}),
        )
    };
    let unk = tokens.iter().find(|t| *t == "<unk>").cloned();
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added_tokens(tokens, types),
        "normalizer": normalizer,
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": decoder,
        "model": {"type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
                  "ignore_merges": false, "vocab": vocab, "merges": merges}
    })
}

/// A `tokenizer.json` for a byte-level BPE vocabulary from GGUF metadata.
/// `pre` is llama.cpp's pre-tokenizer name (`tokenizer.ggml.pre`).
fn bpe_tokenizer_json(tokens: &[String], merges: &[String], types: &[i32], pre: &str) -> Value {
    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(id, token)| (token.clone(), json!(id)))
        .collect();
    let merges: Vec<Value> = merges
        .iter()
        .filter_map(|m| m.split_once(' '))
        .map(|(a, b)| json!([a, b]))
        .collect();
    // llama.cpp token types: 3 = control, 4 = user-defined; both match whole.
    let added = added_tokens(tokens, types);
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let (normalizer, pre_tokenizer) = match pre {
        "smollm" => (
            Value::Null,
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        ),
        "qwen2" => (
            json!({"type": "NFC"}),
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": false},
                byte_level(false)]}),
        ),
        _ => (Value::Null, byte_level(true)),
    };
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": byte_level(true),
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": merges}
    })
}
