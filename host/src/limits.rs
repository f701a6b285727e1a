//! Limits on what one request may ask of the server, checked before any work is done for it:
//! tensor rank, elements per tensor, bytes per BYTES element and JSON nesting depth. Request
//! size is limited where bodies are read (`--http-max-input-size`, `--grpc-max-message-size`,
//! a tenant's `max_request_bytes`).

use crate::{
    error::{Error, Result},
    inference::InferRequest,
    tensor::{bytes_elements, element_count, DataType, Tensor},
};

/// Server-wide request limits (`--max-tensor-rank`, `--max-tensor-elements`,
/// `--max-string-bytes`, `--max-json-depth`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    /// Most dimensions a tensor's shape may have.
    pub max_rank: usize,
    /// Most elements one tensor may have.
    pub max_elements: usize,
    /// Longest BYTES element, in bytes.
    pub max_string_bytes: usize,
    /// Deepest nesting of arrays and objects in a JSON request.
    pub max_json_depth: usize,
}

impl Default for RequestLimits {
    fn default() -> Self {
        Self {
            max_rank: 32,
            max_elements: 64 * 1024 * 1024,
            max_string_bytes: 16 * 1024 * 1024,
            // Triton's HTTP_MAX_JSON_NESTING_DEPTH.
            max_json_depth: 100,
        }
    }
}

impl RequestLimits {
    /// Checks one shape; `what` names the tensor in the error (e.g. `input 'INPUT0'`).
    pub fn check_shape(&self, what: &str, shape: &[i64]) -> Result<()> {
        if shape.len() > self.max_rank {
            return Err(Error::invalid(format!(
                "{what} has {} dimensions; the server allows at most {} (--max-tensor-rank)",
                shape.len(),
                self.max_rank
            )));
        }
        match element_count(shape) {
            Some(n) if n <= self.max_elements => Ok(()),
            // Shown as a product, not as the (possibly overflowing) count.
            _ => Err(Error::invalid(format!(
                "{what} has {} elements; the server allows at most {} per tensor (--max-tensor-elements)",
                shape
                    .iter()
                    .map(i64::to_string)
                    .collect::<Vec<_>>()
                    .join("x"),
                self.max_elements
            ))),
        }
    }

    /// Checks a tensor's shape and, for BYTES, each element's length.
    pub fn check_tensor(&self, what: &str, tensor: &Tensor) -> Result<()> {
        self.check_shape(what, &tensor.shape)?;
        if tensor.datatype == DataType::Bytes {
            if let Some((i, long)) = bytes_elements(&tensor.data)
                .enumerate()
                .find(|(_, e)| e.len() > self.max_string_bytes)
            {
                return Err(Error::invalid(format!(
                    "{what}: BYTES element {i} is {} bytes long; the server allows at most {} (--max-string-bytes)",
                    long.len(),
                    self.max_string_bytes
                )));
            }
        }
        Ok(())
    }

    /// Checks every input of a request.
    pub fn check_request(&self, request: &InferRequest) -> Result<()> {
        for tensor in &request.inputs {
            let what = format!(
                "input '{}' of the request for model '{}'",
                tensor.name, request.model_name
            );
            self.check_tensor(&what, tensor)?;
        }
        Ok(())
    }

    /// Checks how deeply a JSON document nests arrays and objects, without parsing it (so that
    /// a deep document costs one pass, not a recursion per level).
    pub fn check_json_depth(&self, json: &[u8]) -> Result<()> {
        let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
        for &b in json {
            if in_string {
                match (escaped, b) {
                    (true, _) => escaped = false,
                    (false, b'\\') => escaped = true,
                    (false, b'"') => in_string = false,
                    _ => {}
                }
                continue;
            }
            match b {
                b'"' => in_string = true,
                b'[' | b'{' => {
                    depth += 1;
                    if depth > self.max_json_depth {
                        // Triton's words first (its clients and tests match them).
                        return Err(Error::invalid(format!(
                            "JSON nesting depth exceeds maximum allowed limit ({}): the request \
                             JSON nests arrays and objects more than {} levels deep \
                             (--max-json-depth)",
                            self.max_json_depth, self.max_json_depth
                        )));
                    }
                }
                b']' | b'}' => depth = depth.saturating_sub(1),
                _ => {}
            }
        }
        Ok(())
    }
}

/// The most sequences one client request may start (OpenAI's `n` choices of each of its
/// prompts): the frontends refuse more, and a generation model keeps room for that many.
pub const MAX_SEQUENCES_PER_REQUEST: usize = 64;

/// The longest guide a request may send for constrained decoding (a schema or grammar), in
/// bytes.
pub const MAX_GUIDE_BYTES: usize = 64 * 1024;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::push_bytes_element;

    fn limits() -> RequestLimits {
        RequestLimits {
            max_rank: 3,
            max_elements: 100,
            max_string_bytes: 5,
            max_json_depth: 4,
        }
    }

    #[test]
    fn shapes_over_the_limits_are_refused_by_name() {
        let l = limits();
        assert!(l.check_shape("input 'X'", &[2, 5, 10]).is_ok());
        let e = l.check_shape("input 'X'", &[1, 1, 1, 1]).unwrap_err();
        assert!(
            e.message.contains("input 'X' has 4 dimensions") && e.message.contains("at most 3")
        );
        let e = l.check_shape("input 'X'", &[11, 10]).unwrap_err();
        assert!(
            e.message.contains("11x10 elements") && e.message.contains("--max-tensor-elements")
        );
        // An overflowing product is refused, not wrapped.
        let e = l
            .check_shape("input 'X'", &[i64::MAX, i64::MAX])
            .unwrap_err();
        assert!(e.message.contains("--max-tensor-elements"));
    }

    #[test]
    fn long_strings_are_refused_with_their_index() {
        let mut data = Vec::new();
        push_bytes_element(&mut data, b"short");
        push_bytes_element(&mut data, b"too long");
        let t = Tensor {
            name: "TEXT".into(),
            datatype: DataType::Bytes,
            shape: vec![2],
            data: data.into(),
        };
        let e = limits().check_tensor("input 'TEXT'", &t).unwrap_err();
        assert!(
            e.message.contains("BYTES element 1 is 8 bytes"),
            "{}",
            e.message
        );
    }

    #[test]
    fn json_depth_ignores_brackets_inside_strings() {
        let l = limits();
        assert!(l.check_json_depth(br#"{"a":[[["x"]]]}"#).is_ok());
        assert!(l.check_json_depth(br#"{"a":"[[[[[[\"[[[["}"#).is_ok());
        let e = l.check_json_depth(br#"{"a":[[[[1]]]]}"#).unwrap_err();
        assert!(e.message.contains("more than 4 levels"));
    }
}
