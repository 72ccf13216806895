//! Alpaca to chat: `{"instruction", "input", "output"}` records become
//! `{"messages": [{"role": "system"?}, {"role": "user"}, {"role": "assistant"}]}`.
//!
//! The user turn is the instruction, followed by a blank line and the input
//! when the input is not empty. Config: `{"system": "You are helpful."}` adds a
//! system turn to every record. Records without instruction or output are
//! errors; malformed JSON is an error.

use mlxgate_guest::dataset::*;
use serde::Deserialize;
use serde_json::json;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct AlpacaToChat {
    system: Option<String>,
}

#[derive(Deserialize)]
struct Alpaca {
    instruction: Option<String>,
    #[serde(default)]
    input: Option<String>,
    output: Option<String>,
}

impl DatasetTransform for AlpacaToChat {
    fn init(config: &str) -> Result<Self, String> {
        if config.trim().is_empty() {
            return Ok(Self::default());
        }
        serde_json::from_str(config).map_err(|e| format!("alpaca-to-chat config: {e}"))
    }

    fn transform_record(&self, record: &str) -> RecordOutcome {
        let rec: Alpaca = match serde_json::from_str(record) {
            Ok(r) => r,
            Err(e) => return RecordOutcome::Error(format!("invalid JSON: {e}")),
        };
        let Some(instruction) = rec.instruction.filter(|s| !s.trim().is_empty()) else {
            return RecordOutcome::Error("missing `instruction`".to_string());
        };
        let Some(output) = rec.output else {
            return RecordOutcome::Error("missing `output`".to_string());
        };
        let user = match rec.input.as_deref().map(str::trim) {
            Some(input) if !input.is_empty() => format!("{instruction}\n\n{input}"),
            _ => instruction,
        };
        let mut messages = Vec::with_capacity(3);
        if let Some(system) = &self.system {
            messages.push(json!({"role": "system", "content": system}));
        }
        messages.push(json!({"role": "user", "content": user}));
        messages.push(json!({"role": "assistant", "content": output}));
        RecordOutcome::Keep(json!({ "messages": messages }).to_string())
    }
}

mlxgate_guest::export_dataset_transform!(AlpacaToChat);
