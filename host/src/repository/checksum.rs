//! Triton's checksum repository agent, built in: before a model loads, each file named in
//! `model_repository_agents { agents [ { name: "checksum" parameters { key: "MD5:<path>"
//! value: "<hex digest>" } } ] }` (a path relative to the model's folder) must have that MD5
//! digest, else the load fails naming the file and both digests. No other agent is available.

use std::path::Path;

use md5::{Digest, Md5};

use crate::{names::ModelFilePath, proto::inference::ModelConfig};

/// The one repository agent this server runs.
pub const AGENT: &str = "checksum";

/// Checks the files of the model in `model_dir` against its checksum agent's digests; the
/// error names the field, the file and what differs.
pub fn verify(config: &ModelConfig, model_dir: &Path) -> Result<(), String> {
    let Some(agents) = &config.model_repository_agents else {
        return Ok(());
    };
    for (i, agent) in agents.agents.iter().enumerate() {
        let field = format!("model_repository_agents.agents[{i}]");
        if agent.name != AGENT {
            return Err(format!(
                "field '{field}.name': repository agent '{}' is not available (this server \
                 runs: {AGENT})",
                agent.name
            ));
        }
        let mut keys: Vec<&String> = agent.parameters.keys().collect();
        keys.sort();
        for key in keys {
            let expected = agent.parameters[key].trim();
            let (algorithm, file) = key.split_once(':').ok_or_else(|| {
                format!(
                    "field '{field}.parameters': key '{key}' must read '<algorithm>:<file>', \
                     such as 'MD5:1/model.onnx'"
                )
            })?;
            if !algorithm.eq_ignore_ascii_case("md5") {
                return Err(format!(
                    "field '{field}.parameters': checksum algorithm '{algorithm}' of key \
                     '{key}' is not supported (MD5)"
                ));
            }
            let path = ModelFilePath::parse(file).map_err(|_| {
                format!(
                    "field '{field}.parameters': key '{key}' must name a file by a path \
                     relative to the model's folder, without '.' or '..'"
                )
            })?;
            let bytes = std::fs::read(model_dir.join(path.to_path())).map_err(|e| {
                format!("field '{field}.parameters': cannot read '{file}' to check its MD5: {e}")
            })?;
            let got: String = Md5::digest(&bytes)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            if !got.eq_ignore_ascii_case(expected) {
                return Err(format!(
                    "field '{field}.parameters': mismatched MD5 hash for file {file}, expect: \
                     {expected}, got: {got}"
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::inference::{model_repository_agents::Agent, ModelRepositoryAgents};

    fn with(name: &str, key: &str, value: &str) -> ModelConfig {
        ModelConfig {
            model_repository_agents: Some(ModelRepositoryAgents {
                agents: vec![Agent {
                    name: name.into(),
                    parameters: [(key.to_owned(), value.to_owned())].into(),
                }],
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_file_passes_with_its_digest_and_fails_with_another() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("1")).unwrap();
        std::fs::write(dir.path().join("1/weights"), b"abc").unwrap();
        // MD5("abc"), RFC 1321's test suite.
        let abc = "900150983cd24fb0d6963f7d28e17f72";
        verify(&with("checksum", "MD5:1/weights", abc), dir.path()).unwrap();
        let e = verify(
            &with("checksum", "md5:1/weights", &"0".repeat(32)),
            dir.path(),
        )
        .unwrap_err();
        assert!(
            e.contains("mismatched MD5 hash for file 1/weights") && e.contains(abc),
            "{e}"
        );
        let e = verify(&with("checksum", "MD5:../secret", abc), dir.path()).unwrap_err();
        assert!(e.contains("relative to the model's folder"), "{e}");
        let e = verify(&with("checksum", "SHA1:1/weights", abc), dir.path()).unwrap_err();
        assert!(e.contains("'SHA1'") && e.contains("not supported"), "{e}");
        let e = verify(&with("decrypt", "k", "v"), dir.path()).unwrap_err();
        assert!(
            e.contains("repository agent 'decrypt' is not available"),
            "{e}"
        );
    }
}
