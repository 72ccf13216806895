//! JSON laid out as Python's `json.dumps(..., ensure_ascii=False)` writes
//! it: `", "` between items and `": "` after keys. Chat templates are
//! written for Hugging Face's `tojson` filter, which is that function;
//! using the same layout keeps prompts token for token what Python
//! mlx-lm renders, and tool calls in the history in the form the model
//! wrote them.

use std::io;

use serde::Serialize;
use serde_json::ser::{CompactFormatter, Formatter, PrettyFormatter};

/// `value` as `json.dumps(value, ensure_ascii=False)`.
pub fn python_dumps<T: Serialize + ?Sized>(value: &T) -> String {
    write(value, PythonFormatter)
}

/// `value` as `json.dumps(value, ensure_ascii=False, indent=indent)`.
pub fn python_dumps_indented<T: Serialize + ?Sized>(value: &T, indent: usize) -> String {
    let indent = " ".repeat(indent);
    write(value, PrettyFormatter::with_indent(indent.as_bytes()))
}

fn write<T: Serialize + ?Sized, F: Formatter>(value: &T, formatter: F) -> String {
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
    // Writing to a Vec fails only for values that are not JSON (maps with
    // non-string keys), which callers never pass.
    if value.serialize(&mut ser).is_err() {
        return "null".to_owned();
    }
    String::from_utf8(out).unwrap_or_default()
}

/// Compact JSON with Python's default separators.
struct PythonFormatter;

impl Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }

    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        CompactFormatter.begin_object_value(w)?;
        w.write_all(b" ")
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn layout_matches_python() {
        let v = json!({"name": "get_weather", "arguments": {"city": "Zürich", "days": [1, 2.5], "q": "a\"<b>\n"}});
        // json.dumps(v, ensure_ascii=False), keys in insertion order.
        assert_eq!(
            python_dumps(&v),
            r#"{"name": "get_weather", "arguments": {"city": "Zürich", "days": [1, 2.5], "q": "a\"<b>\n"}}"#
        );
        assert_eq!(python_dumps(&json!([])), "[]");
        assert_eq!(
            python_dumps_indented(&json!({"a": [1]}), 2),
            "{\n  \"a\": [\n    1\n  ]\n}"
        );
    }
}
