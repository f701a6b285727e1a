//! A test stage whose behaviour is chosen by the `mode` parameter of its config.pbtxt. It
//! echoes `INPUT0` (FP32) to `OUTPUT0` and writes what it observed to `REPORT` (BYTES [1]).
//!
//! Modes: `echo`, `raw_echo` (returns INPUT0's bytes untouched, OUTPUT0 only), `loop` (spins
//! forever), `alloc` (grows memory without bound), `panic`, `sandbox` (tries files,
//! environment, arguments and sockets, reads its own version directory, and reports each
//! outcome), `huge_output` (returns
//! 100 MiB), `wrong_output` (returns INT32 for an FP32 output), `trap_on_negative` (panics
//! when the first input value is negative), `bls` (adds INPUT0 to itself through the `simple`
//! model via the host), `call` (forwards INPUT0 to the probe named by parameter `target` and
//! returns its OUTPUT0), `stream` (decoupled: one response per input value, then none),
//! `fail_init`.

use wasmtron_guest::{export_stage, host, Config, Error, LogLevel, Request, Result, Stage, Tensor};

struct Probe {
    mode: String,
    calls: u64,
    /// Model that `call` mode forwards to (parameter `target`).
    target: String,
}

/// Echo plus one REPORT string per batch row.
fn report(request: &Request, echo: Tensor, text: &str) -> Result<Vec<Tensor>> {
    let rows = request.input("INPUT0")?.shape.first().copied().unwrap_or(1);
    let texts = vec![text; rows.max(0) as usize];
    request.select(vec![
        echo,
        Tensor::from_bytes_elements("REPORT", &[rows, 1], texts),
    ])
}

fn sandbox_report() -> String {
    let mut lines = Vec::new();
    lines.push(format!(
        "read /etc/passwd: {:?}",
        std::fs::read("/etc/passwd").map(|b| b.len())
    ));
    lines.push(format!(
        "read_dir /: {:?}",
        std::fs::read_dir("/").map(|d| d.count())
    ));
    lines.push(format!(
        "write /tmp/wasmtron-probe-escape: {:?}",
        std::fs::write("/tmp/wasmtron-probe-escape", b"escaped")
    ));
    lines.push(format!(
        "read /model/model.wasm: {:?}",
        std::fs::read("/model/model.wasm").map(|b| b.len())
    ));
    lines.push(format!(
        "read /model/../config.pbtxt: {:?}",
        std::fs::read("/model/../config.pbtxt").map(|b| b.len())
    ));
    lines.push(format!(
        "write /model/planted: {:?}",
        std::fs::write("/model/planted", b"planted")
    ));
    lines.push(format!("env: {:?}", std::env::vars().collect::<Vec<_>>()));
    lines.push(format!("args: {:?}", std::env::args().collect::<Vec<_>>()));
    lines.push(format!(
        "connect 127.0.0.1:22: {:?}",
        std::net::TcpStream::connect("127.0.0.1:22").map(|_| "connected")
    ));
    lines.join("\n")
}

impl Stage for Probe {
    fn init(config: &Config) -> Result<Self> {
        let mode = config.parameter("mode").unwrap_or("echo").to_owned();
        if mode == "fail_init" {
            return Err(Error::invalid("probe refuses to start (mode fail_init)"));
        }
        host::log(LogLevel::Info, &format!("probe started in mode {mode}"));
        let target = config.parameter("target").unwrap_or("echo").to_owned();
        Ok(Probe {
            mode,
            calls: 0,
            target,
        })
    }

    fn execute(&mut self, request: &Request) -> Result<Vec<Tensor>> {
        self.calls += 1;
        let input = request.input("INPUT0")?;
        if self.mode == "raw_echo" {
            // The bytes go back untouched: what crossing the boundary costs, without guest work.
            return request.select(vec![Tensor {
                name: "OUTPUT0".into(),
                ..input.clone()
            }]);
        }
        let values = input.to_f32()?;
        let echo = Tensor::from_f32("OUTPUT0", &input.shape, &values);
        match self.mode.as_str() {
            "echo" => report(request, echo, &format!("calls={}", self.calls)),
            "loop" => {
                let mut x: u64 = 0;
                loop {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
            }
            "alloc" => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(vec![1u8; 1 << 20]);
                    std::hint::black_box(&hoard);
                }
            }
            "panic" => panic!("probe panicked on purpose"),
            "sandbox" => report(request, echo, &sandbox_report()),
            "huge_output" => {
                let n = 100 << 20 >> 2;
                report(
                    request,
                    Tensor::from_f32("OUTPUT0", &[1, n as i64], &vec![0.0; n]),
                    "huge",
                )
            }
            "wrong_output" => report(
                request,
                Tensor::from_i32("OUTPUT0", &input.shape, &vec![0; values.len()]),
                "wrong",
            ),
            "trap_on_negative" => {
                if values.first().is_some_and(|v| *v < 0.0) {
                    panic!("negative input");
                }
                report(request, echo, &format!("calls={}", self.calls))
            }
            "bls" => {
                let ints: Vec<i32> = values.iter().map(|v| *v as i32).collect();
                let a = Tensor::from_i32("INPUT0", &[1, 16], &ints);
                let b = Tensor::from_i32("INPUT1", &[1, 16], &ints);
                let out = host::infer("simple", None, &[a, b], &["OUTPUT0"])?;
                let sums: Vec<f32> = out[0].to_i32()?.iter().map(|v| *v as f32).collect();
                report(
                    request,
                    Tensor::from_f32("OUTPUT0", &input.shape, &sums),
                    "bls",
                )
            }
            "stream" => {
                // One response per input value (OUTPUT0 [1, 1] and REPORT "i/n"), then none.
                let n = values.len();
                for (i, v) in values.iter().enumerate() {
                    let one = Tensor::from_f32("OUTPUT0", &[1, 1], &[*v]);
                    let report = Tensor::from_bytes_elements(
                        "REPORT",
                        &[1, 1],
                        vec![format!("{}/{n}", i + 1)],
                    );
                    host::respond(&request.select(vec![one, report])?)?;
                }
                Ok(Vec::new())
            }
            "call" => {
                let forward = Tensor::from_f32("INPUT0", &input.shape, &values);
                let out = host::infer(&self.target, None, &[forward], &["OUTPUT0"])?;
                report(request, out[0].clone(), "called")
            }
            other => Err(Error::invalid(format!("unknown mode '{other}'"))),
        }
    }
}

export_stage!(Probe);
