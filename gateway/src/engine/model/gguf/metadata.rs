//! Typed metadata lookups (strings, numbers, arrays) that the model config
//! and the tokenizer make, answered alike by MLX's loader ([`GgufFile`]) and
//! by ours ([`GgufReader`]).

use mlx_rs::Dtype;
use mlx_rs::io::GgufFile;

use super::{GgufReader, MetaValue};
use crate::engine::model::LoadError;

/// Metadata lookups the model config and the tokenizer need, answered by MLX's
/// loader ([`GgufFile`]) or by ours ([`GgufReader`]).
pub trait GgufMetadata {
    fn meta_string(&self, key: &str) -> Result<Option<String>, LoadError>;
    fn meta_strings(&self, key: &str) -> Result<Option<Vec<String>>, LoadError>;
    /// A number or boolean (booleans as 0 / 1).
    fn meta_number(&self, key: &str) -> Result<Option<f64>, LoadError>;
    /// An array of numbers (token types, scores).
    fn meta_numbers(&self, key: &str) -> Result<Option<Vec<f64>>, LoadError>;
}

impl GgufMetadata for GgufReader {
    fn meta_string(&self, key: &str) -> Result<Option<String>, LoadError> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(self.wrong_type(key, "a string", other)),
        }
    }

    fn meta_strings(&self, key: &str) -> Result<Option<Vec<String>>, LoadError> {
        let items = self.array(key, "an array of strings")?;
        items
            .map(|items| {
                items
                    .iter()
                    .map(|v| {
                        v.as_str()
                            .map(str::to_owned)
                            .ok_or_else(|| self.wrong_type(key, "an array of strings", v))
                    })
                    .collect()
            })
            .transpose()
    }

    fn meta_number(&self, key: &str) -> Result<Option<f64>, LoadError> {
        match self.get(key) {
            None => Ok(None),
            Some(value) => value
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.wrong_type(key, "a number", value)),
        }
    }

    fn meta_numbers(&self, key: &str) -> Result<Option<Vec<f64>>, LoadError> {
        let items = self.array(key, "an array of numbers")?;
        items
            .map(|items| {
                items
                    .iter()
                    .map(|v| {
                        v.as_f64()
                            .ok_or_else(|| self.wrong_type(key, "an array of numbers", v))
                    })
                    .collect()
            })
            .transpose()
    }
}

impl GgufReader {
    fn array(&self, key: &str, wanted: &str) -> Result<Option<&[MetaValue]>, LoadError> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::Array(items)) => Ok(Some(items)),
            Some(other) => Err(self.wrong_type(key, wanted, other)),
        }
    }

    fn wrong_type(&self, key: &str, wanted: &str, found: &MetaValue) -> LoadError {
        let found = match found {
            MetaValue::String(_) => "a string".to_owned(),
            MetaValue::Array(_) => "an array".to_owned(),
            other => format!("{other:?}"),
        };
        LoadError::Io(
            self.path().to_owned(),
            format!("metadata `{key}` should be {wanted}, found {found}"),
        )
    }
}

impl GgufMetadata for GgufFile {
    fn meta_string(&self, key: &str) -> Result<Option<String>, LoadError> {
        self.get_metadata_string(key).map_err(mlx_meta)
    }

    fn meta_strings(&self, key: &str) -> Result<Option<Vec<String>>, LoadError> {
        self.get_metadata_strings(key).map_err(mlx_meta)
    }

    fn meta_number(&self, key: &str) -> Result<Option<f64>, LoadError> {
        let Some(array) = self.get_metadata_array(key).map_err(mlx_meta)? else {
            return Ok(None);
        };
        let array = array
            .as_dtype(Dtype::Float64)
            .map_err(|e| LoadError::Mlx(e.to_string()))?;
        Ok(array.as_slice::<f64>().first().copied())
    }

    fn meta_numbers(&self, key: &str) -> Result<Option<Vec<f64>>, LoadError> {
        let Some(array) = self.get_metadata_array(key).map_err(mlx_meta)? else {
            return Ok(None);
        };
        let array = array
            .as_dtype(Dtype::Float64)
            .map_err(|e| LoadError::Mlx(e.to_string()))?;
        Ok(Some(array.as_slice::<f64>().to_vec()))
    }
}

fn mlx_meta(e: mlx_rs::io::GgufError) -> LoadError {
    LoadError::Mlx(e.to_string())
}
