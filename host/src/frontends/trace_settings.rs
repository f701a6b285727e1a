//! Triton's trace settings as values: what `trace_level`, `trace_rate`, `trace_count` and
//! `log_frequency` hold, which of them a level (global or a model's) sets itself, and how a
//! change sent to `/v2[/models/<m>]/trace/setting` or the gRPC `TraceSetting` RPC is read —
//! with Triton's rules and words (Triton's `http_server.cc` and `tracer.cc`): a field sent as
//! `null` (or an empty list over gRPC) is cleared and falls back again (a model's to the
//! global setting, the global one to what the server started with); the trace file and mode
//! are fixed at start.

use std::collections::BTreeMap;

use crate::{
    error::{Error, Result},
    inference::TraceLevel,
};

/// The settings in force at one level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Values {
    /// What a traced request records.
    pub level: TraceLevel,
    /// One request in this many is traced.
    pub rate: u32,
    /// How many more requests may be traced (-1: no limit).
    pub count: i32,
    /// Traces per indexed file (`<file>.<n>`); 0: one file.
    pub log_frequency: u32,
}

/// Triton's defaults: level OFF, rate 1000, count -1, log frequency 0.
pub const DEFAULT: Values = Values {
    level: TraceLevel {
        timestamps: false,
        tensors: false,
    },
    rate: 1000,
    count: -1,
    log_frequency: 0,
};

/// The fields a level sets itself; the others fall back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Specified {
    /// `trace_level`.
    pub level: Option<TraceLevel>,
    /// `trace_rate`.
    pub rate: Option<u32>,
    /// `trace_count`.
    pub count: Option<i32>,
    /// `log_frequency`.
    pub log_frequency: Option<u32>,
}

impl Specified {
    /// `base` with the fields set here.
    pub fn over(&self, base: Values) -> Values {
        Values {
            level: self.level.unwrap_or(base.level),
            rate: self.rate.unwrap_or(base.rate),
            count: self.count.unwrap_or(base.count),
            log_frequency: self.log_frequency.unwrap_or(base.log_frequency),
        }
    }

    /// Whether nothing is set here (a model's level is then dropped: it uses the global one).
    pub fn is_empty(&self) -> bool {
        *self == Specified::default()
    }
}

/// One request's changes: for each field, untouched (`None`), cleared (`Some(None)`) or set.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Changes {
    level: Option<Option<TraceLevel>>,
    rate: Option<Option<u32>>,
    count: Option<Option<i32>>,
    log_frequency: Option<Option<u32>>,
}

impl Changes {
    /// Reads a request's fields (`None` or an empty list: clear). Nothing is applied when a
    /// field is refused.
    pub fn parse(fields: BTreeMap<String, Option<Vec<String>>>) -> Result<Changes> {
        let mut changes = Changes::default();
        for (key, value) in fields {
            let values = value.filter(|v| !v.is_empty());
            let one = || -> Result<Option<String>> {
                match values.as_deref() {
                    None => Ok(None),
                    Some([one]) => Ok(Some(one.trim().to_owned())),
                    Some(_) => Err(Error::invalid(format!("{key}: give a single value"))),
                }
            };
            match key.as_str() {
                "trace_file" => {
                    // Exactly Triton's words: its test scripts match the whole message.
                    return Err(Error::invalid(
                        "trace file location can not be updated through network protocol",
                    ));
                }
                "trace_level" => changes.level = Some(values.map(|v| level(&v)).transpose()?),
                "trace_rate" => {
                    changes.rate = Some(one()?.map(|v| unsigned(&key, &v)).transpose()?)
                }
                "log_frequency" => {
                    changes.log_frequency = Some(one()?.map(|v| unsigned(&key, &v)).transpose()?)
                }
                "trace_count" => changes.count = Some(one()?.map(|v| count(&v)).transpose()?),
                "trace_mode" => {
                    return Err(Error::invalid(
                        "trace_mode cannot be changed while the server runs: set it with \
                         --trace-config at start",
                    ))
                }
                other => {
                    return Err(Error::invalid(format!(
                        "unknown trace setting '{other}' (trace_level, trace_rate, trace_count, \
                         log_frequency)"
                    )))
                }
            }
        }
        Ok(changes)
    }

    /// What a level sets itself after these changes.
    pub fn apply(&self, mut to: Specified) -> Specified {
        fn field<T: Copy>(slot: &mut Option<T>, change: Option<Option<T>>) {
            if let Some(change) = change {
                *slot = change;
            }
        }
        field(&mut to.level, self.level);
        field(&mut to.rate, self.rate);
        field(&mut to.count, self.count);
        field(&mut to.log_frequency, self.log_frequency);
        to
    }
}

/// Checks a level's values as Triton does: tracing on with a rate of 0 is refused.
pub fn check(values: &Values) -> Result<()> {
    if values.level.is_on() && values.rate == 0 {
        return Err(Error::invalid(
            "Attempting to set invalid trace setting :sample rate must be non-zero",
        ));
    }
    Ok(())
}

/// A `--trace-config` setting given at start (`level=`, `rate=`, `count=`,
/// `log-frequency=`), applied to `values`.
pub fn configure(values: &mut Values, key: &str, value: &str) -> Result<()> {
    let value = value.trim();
    match key {
        // Repeated levels add up, as in Triton's command line; OFF turns tracing off.
        "level" => {
            let named = level(&[value.to_ascii_uppercase()])?;
            values.level = if named.is_on() {
                TraceLevel {
                    timestamps: values.level.timestamps || named.timestamps,
                    tensors: values.level.tensors || named.tensors,
                }
            } else {
                named
            };
        }
        "rate" => values.rate = unsigned("trace_rate", value)?,
        "count" => values.count = count(value)?,
        "log-frequency" | "log_frequency" => {
            values.log_frequency = unsigned("log_frequency", value)?
        }
        other => {
            return Err(Error::invalid(format!(
                "--trace-config {other}: unknown setting"
            )))
        }
    }
    Ok(())
}

/// The names a level is reported by (`["OFF"]`, `["TIMESTAMPS", "TENSORS"]`, …).
pub fn level_names(level: TraceLevel) -> Vec<String> {
    if !level.is_on() {
        return vec!["OFF".to_owned()];
    }
    let mut names = Vec::new();
    if level.timestamps {
        names.push("TIMESTAMPS".to_owned());
    }
    if level.tensors {
        names.push("TENSORS".to_owned());
    }
    names
}

fn level(names: &[String]) -> Result<TraceLevel> {
    let mut level = TraceLevel::default();
    for name in names {
        match name.trim() {
            "OFF" if names.len() == 1 => {}
            "OFF" => {
                return Err(Error::invalid(
                    "Expect only one trace level 'OFF' is specified",
                ))
            }
            "TIMESTAMPS" => level.timestamps = true,
            "TENSORS" => level.tensors = true,
            other => {
                return Err(Error::invalid(format!(
                    "trace_level '{other}' is not a trace level (OFF, TIMESTAMPS, TENSORS)"
                )))
            }
        }
    }
    Ok(level)
}

fn unsigned(key: &str, value: &str) -> Result<u32> {
    let n: i64 = value
        .parse()
        .map_err(|_| Error::invalid(format!("Unable to parse '{key}', got: {value}")))?;
    u32::try_from(n).map_err(|_| {
        Error::invalid(format!(
            "Unable to parse '{key}', value is out of range [ 0, {} ], got: {value}",
            u32::MAX
        ))
    })
}

fn count(value: &str) -> Result<i32> {
    let n: i64 = value
        .parse()
        .map_err(|_| Error::invalid(format!("Unable to parse 'trace_count', got: {value}")))?;
    if n < -1 {
        return Err(Error::invalid(format!(
            "Unable to parse 'trace_count'. Expecting value >= -1, got:{value}"
        )));
    }
    i32::try_from(n).map_err(|_| {
        Error::invalid(format!(
            "Unable to parse 'trace_count', value is out of range [ -1, {} ], got: {value}",
            i32::MAX
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn changes(pairs: &[(&str, Option<&[&str]>)]) -> Result<Changes> {
        Changes::parse(
            pairs
                .iter()
                .map(|(k, v)| {
                    (
                        k.to_string(),
                        v.map(|v| v.iter().map(|s| s.to_string()).collect()),
                    )
                })
                .collect(),
        )
    }

    #[test]
    fn a_cleared_field_falls_back_and_a_set_one_stays() {
        let start = Values {
            rate: 1,
            level: TraceLevel::TIMESTAMPS,
            ..DEFAULT
        };
        let set = changes(&[
            ("trace_rate", Some(&["12"])),
            ("log_frequency", Some(&["34"])),
            ("trace_level", Some(&["TIMESTAMPS", "TENSORS"])),
        ])
        .unwrap()
        .apply(Specified::default());
        let v = set.over(start);
        assert_eq!((v.rate, v.log_frequency, v.count), (12, 34, -1));
        assert_eq!(level_names(v.level), ["TIMESTAMPS", "TENSORS"]);
        let cleared = changes(&[("trace_rate", None), ("trace_level", Some(&[]))])
            .unwrap()
            .apply(set);
        assert_eq!(cleared.over(start).rate, 1);
        assert_eq!(cleared.over(start).level, TraceLevel::TIMESTAMPS);
        assert_eq!(cleared.log_frequency, Some(34));
    }

    #[test]
    fn refusals_use_tritons_words() {
        for (bad, says) in [
            (
                changes(&[("trace_file", Some(&["/tmp/x"]))]),
                "trace file location can not be updated through network protocol",
            ),
            (
                changes(&[("trace_level", Some(&["OFF", "TIMESTAMPS"]))]),
                "Expect only one trace level 'OFF' is specified",
            ),
            (
                changes(&[("trace_count", Some(&["10000000000"]))]),
                "Unable to parse 'trace_count', value is out of range",
            ),
            (
                changes(&[("trace_count", Some(&["-2"]))]),
                "Expecting value >= -1",
            ),
            (
                changes(&[("trace_rate", Some(&["10000000000"]))]),
                "Unable to parse 'trace_rate', value is out of range",
            ),
            (
                changes(&[("log_frequency", Some(&["x"]))]),
                "Unable to parse 'log_frequency', got: x",
            ),
            (
                changes(&[("trace_colour", Some(&["red"]))]),
                "unknown trace setting",
            ),
        ] {
            let err = bad.unwrap_err();
            assert!(err.message.contains(says), "{}", err.message);
        }
        let on_at_zero = Values {
            level: TraceLevel::TIMESTAMPS,
            rate: 0,
            ..DEFAULT
        };
        assert!(check(&on_at_zero).is_err());
        assert!(check(&Values { rate: 0, ..DEFAULT }).is_ok());
    }
}
