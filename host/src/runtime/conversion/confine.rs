//! The converter's confinement. Converting a model means letting a framework read it, and a
//! framework's reader can run code the file carries (a PyTorch pickle), so the converter runs
//! as if the file were hostile:
//!
//! - in namespaces of its own made by bubblewrap (`bwrap`): no network (a network namespace
//!   with nothing in it), its own process, IPC and host-name namespaces, killed with the server;
//! - seeing only the system's libraries (`/usr`), the converter environment's interpreter and
//!   packages (read-only), and its scratch folder, which holds a copy of the model file and the
//!   one folder the answer is written to: no home folder, no repository, no `/etc` beyond the
//!   loader's cache;
//! - as the unprivileged user `nobody` with no capabilities and no way to gain any (when the
//!   server runs as root; otherwise as the server's own user in a user namespace);
//! - under limits on its address space, CPU time, processes and file size, besides the wall
//!   time the server waits;
//! - with PyTorch's loaders held to `weights_only` (no pickled objects).
//!
//! What the converter leaves behind is checked before the server takes it: only regular files
//! in the output folder are kept, everything else in the scratch folder is removed.

use std::{
    os::unix::process::CommandExt,
    path::{Component, Path, PathBuf},
    process::Command,
};

use super::ConverterSettings;

/// The user the converter runs as when the server is root (`nobody` on Debian and most
/// systems).
const NOBODY: u32 = 65534;

/// Processes (threads included) the converter's user may have: frameworks start a pool per
/// core, a fork bomb stops here.
const MAX_PROCESSES: u64 = 512;

/// The largest file the converter may write (a converted model with its weights).
const MAX_FILE_BYTES: u64 = 16 << 30;

/// The most files the converter may have open.
const MAX_OPEN_FILES: u64 = 4096;

/// How the converter is confined (`--converter-sandbox`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Sandbox {
    /// In bubblewrap's namespaces, as described in this module.
    #[default]
    Bubblewrap,
    /// As a plain child process with the server's rights (only the limits apply): for hosts
    /// without user namespaces, by the operator's explicit choice.
    None,
}

impl std::str::FromStr for Sandbox {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "bwrap" | "bubblewrap" => Ok(Self::Bubblewrap),
            "none" => Ok(Self::None),
            other => Err(format!(
                "'{other}' is not a converter sandbox (bwrap, or none to run the converter \
                 unconfined)"
            )),
        }
    }
}

/// Where one conversion runs: its scratch folder, laid out for the sandbox.
pub struct Workspace {
    scratch: PathBuf,
}

impl Workspace {
    /// Lays out `scratch` (a new private folder): the model copied into `source/`, an empty
    /// `out/`; both handed to the converter's user when it is not the server's.
    pub fn prepare(scratch: &Path, source: &Path) -> std::io::Result<(Self, PathBuf, PathBuf)> {
        let name = source
            .file_name()
            .ok_or_else(|| std::io::Error::other("the model file has no name"))?;
        let copied = scratch.join("source").join(name);
        std::fs::create_dir(scratch.join("source"))?;
        copy_tree(source, &copied)?;
        std::fs::create_dir(scratch.join("out"))?;
        if runs_as_nobody() {
            chown_tree(scratch, NOBODY)?;
        }
        Ok((
            Self {
                scratch: scratch.to_path_buf(),
            },
            copied,
            scratch.join("out").join("model.onnx"),
        ))
    }

    /// Keeps the converter's output and nothing else: the regular files of `out/` move to the
    /// scratch folder's top, owned by the server again (mode 0600); the model copy, caches and
    /// anything else the converter made are removed, links never followed.
    pub fn collect(&self) -> std::io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let out = self.scratch.join("out");
        for entry in std::fs::read_dir(&self.scratch)? {
            let entry = entry?;
            if entry.file_name() != "out" {
                remove_entry(&entry.path())?;
            }
        }
        // SAFETY: geteuid has no preconditions and cannot fail.
        let me = unsafe { libc::geteuid() };
        for entry in std::fs::read_dir(&out)? {
            let entry = entry?;
            let path = entry.path();
            if std::fs::symlink_metadata(&path)?.is_file() {
                let kept = self.scratch.join(entry.file_name());
                std::fs::rename(&path, &kept)?;
                std::os::unix::fs::lchown(&kept, Some(me), None)?;
                std::fs::set_permissions(&kept, std::fs::Permissions::from_mode(0o600))?;
            }
        }
        remove_entry(&out)?;
        std::os::unix::fs::lchown(&self.scratch, Some(me), None)?;
        std::fs::set_permissions(&self.scratch, std::fs::Permissions::from_mode(0o700))
    }
}

/// The command that runs the converter script `script` on the job in `scratch`, confined as
/// `settings` say, with the limits set.
pub fn command(
    settings: &ConverterSettings,
    script: &str,
    scratch: &Path,
) -> Result<Command, String> {
    let python = std::path::absolute(&settings.python).map_err(|e| e.to_string())?;
    let mut command = match settings.sandbox {
        Sandbox::None => Command::new(&python),
        Sandbox::Bubblewrap => bubblewrap(&python, scratch)?,
    };
    command
        .arg("-c")
        .arg(script)
        .current_dir(scratch)
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("HOME", scratch)
        .env("TMPDIR", scratch)
        .env("USER", "nobody")
        .env("LOGNAME", "nobody")
        .env("PYTHONNOUSERSITE", "1")
        .env("PYTHONDONTWRITEBYTECODE", "1")
        // torch.load, torch.export.load and what calls them refuse pickled objects.
        .env("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
        .env("TF_CPP_MIN_LOG_LEVEL", "2")
        .env("CUDA_VISIBLE_DEVICES", "");
    let limits = Limits::of(settings);
    // SAFETY: only setrlimit, which is async-signal-safe, runs between fork and exec.
    unsafe {
        command.pre_exec(move || limits.apply());
    }
    Ok(command)
}

/// A hint for an error from a converter that did not start or answer: bubblewrap's own
/// failures name the way out.
pub fn explain_failure(settings: &ConverterSettings, stderr: &str) -> Option<String> {
    (settings.sandbox == Sandbox::Bubblewrap && stderr.lines().any(|l| l.starts_with("bwrap:")))
        .then(|| {
            "the converter's sandbox (bubblewrap) could not start it: this host needs user or \
         mount namespaces for it; start the server with --converter-sandbox=none to run the \
         converter unconfined (the framework then reads model files with the server's rights)"
                .to_owned()
        })
}

/// The resource limits of the converter process and its children.
#[derive(Clone, Copy)]
struct Limits {
    address_space: u64,
    cpu_seconds: u64,
}

impl Limits {
    fn of(settings: &ConverterSettings) -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
        Self {
            address_space: settings.memory_mb.saturating_mul(1 << 20),
            // Every core busy for the whole wall time, no more.
            cpu_seconds: settings.timeout.as_secs().max(1).saturating_mul(cores),
        }
    }

    fn apply(&self) -> std::io::Result<()> {
        let set = |resource, value: u64| {
            let limit = libc::rlimit {
                rlim_cur: value as libc::rlim_t,
                rlim_max: value as libc::rlim_t,
            };
            // SAFETY: a valid resource and a pointer to a live rlimit.
            if unsafe { libc::setrlimit(resource, &limit) } == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        };
        set(libc::RLIMIT_AS, self.address_space)?;
        set(libc::RLIMIT_CPU, self.cpu_seconds)?;
        set(libc::RLIMIT_NPROC, MAX_PROCESSES)?;
        set(libc::RLIMIT_FSIZE, MAX_FILE_BYTES)?;
        set(libc::RLIMIT_NOFILE, MAX_OPEN_FILES)?;
        set(libc::RLIMIT_CORE, 0)
    }
}

/// Whether the converter runs as `nobody`: when the server is root (bubblewrap then needs no
/// user namespace, and `setpriv` drops to `nobody` inside).
fn runs_as_nobody() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// `bwrap` with the converter's view of the system, ready for the interpreter's arguments.
fn bubblewrap(python: &Path, scratch: &Path) -> Result<Command, String> {
    let bwrap = find_program("bwrap").ok_or_else(|| {
        "the converter runs confined by bubblewrap, which is not installed (Debian: apt install \
         bubblewrap; `make convert-env` installs it); --converter-sandbox=none runs it \
         unconfined"
            .to_owned()
    })?;
    let mut read_only = interpreter_paths(python)?;
    read_only.retain(|p| !under_system(p));
    let read_only = outermost(read_only);
    let mut command = Command::new(bwrap);
    command.args([
        "--unshare-net",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
    ]);
    if !runs_as_nobody() {
        command.args(["--unshare-user", "--cap-drop", "ALL"]);
    }
    command.args(["--ro-bind", "/usr", "/usr"]);
    for dir in ["/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"] {
        match std::fs::read_link(dir) {
            Ok(target) => {
                command.arg("--symlink").arg(target).arg(dir);
            }
            Err(_) if Path::new(dir).is_dir() => {
                command.args(["--ro-bind", dir, dir]);
            }
            Err(_) => {}
        }
    }
    // Folders that lead to the bound ones are made open to all: bubblewrap would make them
    // private to root, which `nobody` could not pass.
    let mut parents: Vec<PathBuf> = std::iter::once(Path::new("/etc/ld.so.cache"))
        .chain(read_only.iter().map(PathBuf::as_path))
        .chain(std::iter::once(scratch))
        .flat_map(ancestors)
        .collect();
    parents.sort();
    parents.dedup();
    for dir in parents {
        command.arg("--perms").arg("0755").arg("--dir").arg(dir);
    }
    for file in ["/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/localtime"] {
        command.arg("--ro-bind-try").arg(file).arg(file);
    }
    for path in &read_only {
        command.arg("--ro-bind").arg(path).arg(path);
    }
    command
        .args(["--proc", "/proc", "--dev", "/dev"])
        .arg("--bind")
        .arg(scratch)
        .arg(scratch)
        .arg("--chdir")
        .arg(scratch)
        .arg("--");
    if runs_as_nobody() {
        let setpriv = find_program("setpriv").ok_or_else(|| {
            "the converter drops to user nobody with setpriv (util-linux), which is not \
             installed"
                .to_owned()
        })?;
        command.arg(setpriv).args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--no-new-privs",
            "--",
        ]);
    }
    command.arg(python);
    Ok(command)
}

/// The folders the interpreter reads: its prefixes, its module search path and the folder of
/// its executable (asked of the interpreter itself, which runs no model here).
fn interpreter_paths(python: &Path) -> Result<Vec<PathBuf>, String> {
    const PROBE: &str = "import json, os, sys; print(json.dumps([sys.prefix, sys.base_prefix, \
                         sys.exec_prefix, sys.base_exec_prefix, \
                         os.path.dirname(os.path.realpath(sys.executable))] + sys.path))";
    let out = Command::new(python)
        .args(["-c", PROBE])
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("PYTHONNOUSERSITE", "1")
        .current_dir("/")
        .output()
        .map_err(|e| format!("cannot start the converter '{}': {e}", python.display()))?;
    let listed: Vec<String> = std::str::from_utf8(&out.stdout)
        .ok()
        .and_then(|text| serde_json::from_str(text.trim()).ok())
        .ok_or_else(|| {
            format!(
                "the converter '{}' did not tell its paths: {}",
                python.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            )
        })?;
    let mut paths: Vec<PathBuf> = listed
        .into_iter()
        .map(PathBuf::from)
        .filter(|p| p.is_absolute() && p.exists() && p != Path::new("/"))
        .collect();
    if let Some(dir) = python.parent() {
        paths.push(dir.to_path_buf());
    }
    Ok(paths)
}

/// Whether `path` is inside what the sandbox binds anyway (`/usr` and the links into it).
fn under_system(path: &Path) -> bool {
    let canonical = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    canonical.starts_with("/usr")
        || ["/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"]
            .iter()
            .any(|d| path.starts_with(d))
}

/// The paths that no other path of the list contains, sorted.
fn outermost(mut paths: Vec<PathBuf>) -> Vec<PathBuf> {
    paths.sort();
    paths.dedup();
    let mut kept: Vec<PathBuf> = Vec::new();
    for path in paths {
        if !kept.iter().any(|k| path.starts_with(k)) {
            kept.push(path);
        }
    }
    kept
}

/// The folders above `path`, outermost first, without `/`.
fn ancestors(path: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut at = PathBuf::new();
    let components: Vec<Component> = path.components().collect();
    for component in components.iter().take(components.len().saturating_sub(1)) {
        at.push(component);
        if at != Path::new("/") {
            out.push(at.clone());
        }
    }
    out
}

fn find_program(name: &str) -> Option<PathBuf> {
    ["/usr/bin", "/bin", "/usr/local/bin", "/usr/sbin", "/sbin"]
        .iter()
        .map(|dir| Path::new(dir).join(name))
        .find(|p| p.is_file())
}

/// Copies a file, or a folder's files and folders, following links in the source (a
/// repository's own layout); the copy is readable by its owner only until handed over.
fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    if std::fs::metadata(from)?.is_dir() {
        std::fs::create_dir(to)?;
        for entry in std::fs::read_dir(from)? {
            let entry = entry?;
            copy_tree(&entry.path(), &to.join(entry.file_name()))?;
        }
        Ok(())
    } else {
        std::fs::copy(from, to).map(|_| ())
    }
}

/// Gives `path` and everything under it to `uid` (links themselves, never their targets).
fn chown_tree(path: &Path, uid: u32) -> std::io::Result<()> {
    std::os::unix::fs::lchown(path, Some(uid), Some(uid))?;
    if std::fs::symlink_metadata(path)?.is_dir() {
        for entry in std::fs::read_dir(path)? {
            chown_tree(&entry?.path(), uid)?;
        }
    }
    Ok(())
}

/// Removes a file, link or folder tree without following links.
fn remove_entry(path: &Path) -> std::io::Result<()> {
    if std::fs::symlink_metadata(path)?.is_dir() {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_outermost_folders_are_bound() {
        let kept = outermost(vec![
            PathBuf::from("/opt/env/lib/python3.11/site-packages"),
            PathBuf::from("/opt/env"),
            PathBuf::from("/opt/base"),
            PathBuf::from("/opt/env"),
        ]);
        assert_eq!(
            kept,
            [PathBuf::from("/opt/base"), PathBuf::from("/opt/env")]
        );
    }

    #[test]
    fn the_folders_above_a_path_lead_from_the_root() {
        assert_eq!(
            ancestors(Path::new("/root/.cache/x")),
            [PathBuf::from("/root"), PathBuf::from("/root/.cache")]
        );
        assert!(ancestors(Path::new("/etc")).is_empty());
    }

    #[test]
    fn the_sandbox_is_chosen_by_name() {
        assert_eq!("bwrap".parse::<Sandbox>(), Ok(Sandbox::Bubblewrap));
        assert_eq!("none".parse::<Sandbox>(), Ok(Sandbox::None));
        assert!("chroot".parse::<Sandbox>().unwrap_err().contains("none"));
    }
}
