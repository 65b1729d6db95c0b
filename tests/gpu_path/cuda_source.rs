//! Every kernel of `prompt-r1-device-kernels` as the CUDA backend compiles it, without a GPU:
//! CubeCL's CUDA C++ code generator (what `burn-cuda` runs before NVRTC) on each kernel in f32,
//! f16 and bf16 at the shapes of the Qwen3 models (each block of queries the attention may take),
//! then, where `PROMPT_R1_NVRTC` names NVIDIA's runtime compiler (`libnvrtc.so`) and
//! `PROMPT_R1_CUDA_INCLUDE` the CUDA headers, NVRTC itself on each source for the architectures
//! of a V100, a T4, an A100, an H100 and a B200, with the options `cubecl-cuda` passes, printing
//! the registers a thread NVRTC's ptxas gives each (the driver compiles the PTX again at load and
//! may differ); no kernel may spill registers to local memory but `paged_decode`, within
//! [`DECODE_SPILL_BYTES`], and the general attention kernel, within [`ATTENTION_SPILL_BYTES`]. `scripts/nvrtc_check.sh` fetches both from PyPI's NVIDIA wheels
//! and runs this (CI does); without them NVRTC's part prints `skipped`. Lavapipe's client
//! defines the kernels: a definition reads the device's and runtime's properties, which none of
//! these kernels' code depends on. Without a Vulkan adapter the test prints `skipped` (and fails
//! where NVRTC was asked for).

use std::ffi::{c_char, c_int, CStr, CString};
use std::path::{Path, PathBuf};

use cubecl::ir::{ElemType, FloatKind, StorageType};
use cubecl::prelude::*;
use cubecl::Compiler;
use cubecl_cpp::cuda::{mma::CudaWmmaCompiler, CudaDialect};
use cubecl_cpp::shared::{CompilationOptions, CppSupportedFeatures};

type CudaCompiler = cubecl_cpp::shared::CppCompiler<CudaDialect<CudaWmmaCompiler>>;

/// The options `cubecl-cuda` 0.10 compiles with for compute capability `arch` (its
/// `runtime.rs`, CUDA 12.8 or later): warps of 32, fast math, grid constants (7.0 on), a fast
/// `tanh` (7.5 on), clusters and `elect.sync` (9.0 on).
fn compilation_options(arch: u32) -> CompilationOptions {
    CompilationOptions {
        warp_size: 32,
        supports_features: CppSupportedFeatures {
            grid_constants: true,
            clusters: arch >= 90,
            fast_math: true,
            fast_tanh: arch >= 75,
            elect_sync: arch >= 90,
        },
    }
}

/// The architectures NVRTC compiles for (V100, T4, A100, H100, B200), with `cubecl-cuda`'s
/// suffix (`sm_90a` from 9.0).
const ARCHITECTURES: [u32; 5] = [70, 75, 80, 90, 100];

#[test]
fn every_kernel_compiles_for_cuda() {
    let asked_for_nvrtc = std::env::var_os("PROMPT_R1_NVRTC").is_some();
    if !crate::common::backend_ready::<burn_wgpu::Vulkan>() {
        assert!(!asked_for_nvrtc, "PROMPT_R1_NVRTC is set, but the kernels cannot be defined here (see `skipped` above)");
        return;
    }
    let client = burn_wgpu::WgpuRuntime::client(&burn_wgpu::WgpuDevice::DefaultDevice);
    let nvrtc = match asked_for_nvrtc {
        false => {
            println!("skipped: NVRTC (PROMPT_R1_NVRTC names no libnvrtc.so; scripts/nvrtc_check.sh); the CUDA C++ is generated, not compiled");
            None
        }
        true => Some(Nvrtc::from_env().unwrap_or_else(|e| panic!("NVRTC: {e}"))),
    };
    let out = std::env::var_os("PROMPT_R1_CUDA_SOURCES").map(PathBuf::from);
    let mut kernels = Vec::new();
    // (name, architecture, CUDA C++) of each kernel. A definition compiles once: its scope's
    // variables are taken as it compiles, so each architecture gets its own.
    let mut sources = Vec::new();
    for arch in ARCHITECTURES {
        for dtype in [FloatKind::F32, FloatKind::F16, FloatKind::BF16] {
            let dtype = StorageType::Scalar(ElemType::Float(dtype));
            for (name, definition) in device_kernels::definitions::definitions(&client, dtype) {
                let kernel = name.split(' ').next().expect("a name").to_string();
                // bf16's tensor-core products begin at compute capability 8.0 (an A100); on
                // older GPUs `has_tensor_cores` sends such passes to the general kernel.
                let before_bf16_products = kernel == "tensor_core_attention" && name.contains("bf16") && arch < 80;
                if !kernels.contains(&kernel) {
                    kernels.push(kernel);
                }
                if before_bf16_products {
                    continue;
                }
                let source = CudaCompiler::default()
                    .compile(definition, &compilation_options(arch), ExecutionMode::Checked, device_kernels::definitions::ADDRESS.unsigned_type())
                    .unwrap_or_else(|e| panic!("{name}: CubeCL's CUDA code generator refused it: {e}"))
                    .to_string();
                assert!(source.contains("extern \"C\" __global__"), "{name}: no kernel entry in\n{source}");
                if let Some(dir) = &out {
                    write_source(dir, &name, arch, &source);
                }
                sources.push((name, arch, source));
            }
        }
    }
    assert_eq!(kernels.len(), launched_kernels(), "a kernel of device-kernels/src has no definition in device_kernels::definitions ({kernels:?})");
    let Some(nvrtc) = &nvrtc else {
        return;
    };
    // NVRTC compiles separate programs on separate threads.
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let reports: Vec<Result<String, String>> = std::thread::scope(|scope| {
        let workers: Vec<_> = sources
            .chunks(sources.len().div_ceil(threads))
            .map(|chunk| scope.spawn(move || chunk.iter().map(|(_, arch, source)| nvrtc.compile(source, *arch)).collect::<Vec<_>>()))
            .collect();
        workers.into_iter().flat_map(|w| w.join().expect("an NVRTC worker")).collect()
    });
    let (mut failures, mut spills) = (Vec::new(), Vec::new());
    for ((name, arch, _), report) in sources.iter().zip(reports) {
        match report.map(|log| Resources::from_log(&log)) {
            Ok(Some(used)) => {
                println!("{name}, sm_{arch}: {} registers, {} bytes spilled", used.registers, used.spilled);
                let allowed = match name {
                    _ if name.starts_with("paged_decode") => DECODE_SPILL_BYTES,
                    _ if name.starts_with("paged_attention") => ATTENTION_SPILL_BYTES,
                    _ => 0,
                };
                if used.spilled > allowed {
                    spills.push(format!("{name} for sm_{arch}: {} bytes of registers spilled to local memory", used.spilled));
                }
            }
            Ok(None) => failures.push(format!("{name} for sm_{arch}: no resource report from ptxas")),
            Err(log) => failures.push(format!("{name} for sm_{arch}:\n{log}")),
        }
    }
    println!("NVRTC {}: {} kernel sources compiled for {ARCHITECTURES:?}", nvrtc.version, sources.len() - failures.len());
    assert!(failures.is_empty(), "NVRTC refused {} kernel sources:\n{}", failures.len(), failures.join("\n"));
    // A spilling kernel keeps part of its state in local memory (device memory behind the
    // caches): none does today but within the allowance below, and one that starts to should be
    // a decision, not a surprise.
    assert!(spills.is_empty(), "{}", spills.join("\n"));
}

/// Bytes `paged_decode`'s variants may spill: ptxas keeps some at 40 to 56 registers a unit and
/// spills 4 to 20 bytes of values that stay the same over the row (stored before the loop over
/// its chunks, loaded once a chunk: one `LDL` a chunk against the chunk's 128 keys and values,
/// `scripts/sass.sh paged_decode_bf16_split_groups_2 100`), where more registers a unit would
/// leave an SM fewer cubes.
const DECODE_SPILL_BYTES: u32 = 32;

/// Bytes the general attention kernel's variants may spill: with `-lineinfo` (as `cubecl-cuda`
/// compiles) ptxas keeps some at 32 to 72 registers a unit and spills a few words that it sets
/// before the loop over tiles and reads once a tile or after it (`STL` in the prologue, `LDL`
/// at a loop's head or after the last barrier, against a tile's thousands of products and its
/// keys' and values' loads; none without `-lineinfo`). How many bytes varies from run to run, not
/// only by architecture: CubeCL's code generator declares a kernel's variables in an order that
/// changes between processes. Before its tiles were staged in vectors (the fiftieth session)
/// two runs here spilled 0 to 8 bytes a variant (CI once 16); since, two runs spilled 4 to 52
/// bytes, the most in the f32 variants for sm_100 (`scripts/sass.sh
/// paged_attention_f32_ragged_groups_4_queries_4 100`: seven words, stored once, loaded at the
/// loops' heads), where the vectors take 8 of a tile's 64 round trips to memory a unit. The
/// H200's profile of the bf16 prefill variant (scalar loads) counted no local-memory request
/// (BENCHMARKS.md, seventh lease). The driver compiles the PTX again at load and may choose
/// otherwise.
const ATTENTION_SPILL_BYTES: u32 = 64;

/// The kernels `device-kernels/src` declares (`#[cube(launch...)]`).
fn launched_kernels() -> usize {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../device-kernels/src");
    std::fs::read_dir(&dir)
        .expect("device-kernels/src")
        .map(|entry| std::fs::read_to_string(entry.expect("a file").path()).expect("a source file"))
        .map(|source| source.matches("#[cube(launch").count())
        .sum()
}

/// What ptxas reports a kernel uses: registers a thread, and bytes spilled to local memory.
struct Resources {
    registers: u32,
    spilled: u32,
}

impl Resources {
    /// From ptxas's `-v` report in NVRTC's log (one kernel a program).
    fn from_log(log: &str) -> Option<Self> {
        let number_before = |line: &str, unit: &str| -> Option<u32> { line.split(unit).next()?.split_whitespace().last()?.parse().ok() };
        let registers = log.lines().find(|l| l.contains(" registers"))?;
        let spills = log.lines().find(|l| l.contains("spill stores"))?;
        Some(Self {
            registers: number_before(registers, " registers")?,
            spilled: number_before(spills, " bytes spill stores")?,
        })
    }
}

fn write_source(dir: &Path, name: &str, arch: u32, source: &str) {
    std::fs::create_dir_all(dir).expect("PROMPT_R1_CUDA_SOURCES: a folder");
    let file = format!("{}.sm_{arch}.cu", name.replace([' ', '/'], "_"));
    std::fs::write(dir.join(file), source).expect("a CUDA source written");
}

/// NVIDIA's runtime compiler, loaded from `PROMPT_R1_NVRTC`, with the CUDA headers of
/// `PROMPT_R1_CUDA_INCLUDE`: folders separated by `:`, the first holding the runtime's headers
/// (`cuda_bf16.h`), another `crt/mma.h` (the tensor cores' `wmma`, from the nvcc wheel; a CUDA
/// toolkit's `include` holds both).
struct Nvrtc {
    library: libloading::Library,
    include: Vec<String>,
    version: String,
}

type Program = *mut std::ffi::c_void;

impl Nvrtc {
    fn from_env() -> Result<Self, String> {
        let path = std::env::var("PROMPT_R1_NVRTC").map_err(|e| format!("PROMPT_R1_NVRTC: {e}"))?;
        let folders = std::env::var("PROMPT_R1_CUDA_INCLUDE").map_err(|_| "PROMPT_R1_CUDA_INCLUDE names no CUDA headers".to_string())?;
        let include: Vec<String> = folders.split(':').filter(|f| !f.is_empty()).map(String::from).collect();
        for header in ["cuda_bf16.h", "crt/mma.h"] {
            if !include.iter().any(|folder| Path::new(folder).join(header).exists()) {
                return Err(format!("none of PROMPT_R1_CUDA_INCLUDE's folders ({folders}) holds {header}"));
            }
        }
        // SAFETY: loading NVRTC runs its initialisers, which have no preconditions.
        let library = unsafe { libloading::Library::new(&path) }.map_err(|e| format!("{path}: {e}"))?;
        let mut nvrtc = Self { library, include, version: String::new() };
        let (mut major, mut minor) = (0, 0);
        // SAFETY: nvrtcVersion writes two ints.
        nvrtc.check("nvrtcVersion", unsafe { nvrtc.symbol::<unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int>(b"nvrtcVersion\0")(&mut major, &mut minor) })?;
        nvrtc.version = format!("{major}.{minor}");
        Ok(nvrtc)
    }

    /// # Safety
    /// `T` must be the C signature of the symbol `name`.
    unsafe fn symbol<T: Copy>(&self, name: &[u8]) -> T {
        *unsafe { self.library.get::<T>(name) }.unwrap_or_else(|e| panic!("NVRTC lacks {}: {e}", String::from_utf8_lossy(name)))
    }

    fn check(&self, call: &str, status: c_int) -> Result<(), String> {
        match status {
            0 => Ok(()),
            _ => Err(format!("{call} returned NVRTC error {status}")),
        }
    }

    /// Compiles `source` for `sm_{arch}` as `cubecl-cuda` does, with ptxas's report of each
    /// kernel's resources: the program's log, as `Err` on failure.
    fn compile(&self, source: &str, arch: u32) -> Result<String, String> {
        let suffix = if arch >= 90 { "a" } else { "" };
        let mut options = vec![format!("--gpu-architecture=sm_{arch}{suffix}"), "-lineinfo".into(), "--ptxas-options=-v".into()];
        options.extend(self.include.iter().map(|folder| format!("--include-path={folder}")));
        let options: Vec<CString> = options.into_iter().map(|o| CString::new(o).expect("no NUL")).collect();
        let pointers: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
        let source = CString::new(source).expect("a source without NUL");
        let mut program: Program = std::ptr::null_mut();
        // SAFETY: the signatures are NVRTC's (nvrtc.h); every pointer outlives the calls, and
        // the program is destroyed before returning.
        unsafe {
            type Create = unsafe extern "C" fn(*mut Program, *const c_char, *const c_char, c_int, *const *const c_char, *const *const c_char) -> c_int;
            type CompileProgram = unsafe extern "C" fn(Program, c_int, *const *const c_char) -> c_int;
            type LogSize = unsafe extern "C" fn(Program, *mut usize) -> c_int;
            type Log = unsafe extern "C" fn(Program, *mut c_char) -> c_int;
            type Destroy = unsafe extern "C" fn(*mut Program) -> c_int;
            let create = self.symbol::<Create>(b"nvrtcCreateProgram\0");
            self.check("nvrtcCreateProgram", create(&mut program, source.as_ptr(), c"kernel.cu".as_ptr(), 0, std::ptr::null(), std::ptr::null()))?;
            let status = self.symbol::<CompileProgram>(b"nvrtcCompileProgram\0")(program, pointers.len() as c_int, pointers.as_ptr());
            let mut size = 0;
            let mut log = Vec::new();
            let read = self.check("nvrtcGetProgramLogSize", self.symbol::<LogSize>(b"nvrtcGetProgramLogSize\0")(program, &mut size)).and_then(|()| {
                log = vec![0 as c_char; size.max(1)];
                self.check("nvrtcGetProgramLog", self.symbol::<Log>(b"nvrtcGetProgramLog\0")(program, log.as_mut_ptr()))
            });
            self.symbol::<Destroy>(b"nvrtcDestroyProgram\0")(&mut program);
            read?;
            let log = CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned();
            match status {
                0 => Ok(log),
                _ => Err(log),
            }
        }
    }
}

/// The report's numbers are read from ptxas's wording (CUDA 12.9's), spills included.
#[test]
fn ptxas_reports_are_read() {
    let log = "ptxas info    : Compiling entry function 'k' for 'sm_90a'\n\
               ptxas info    : Function properties for k\n\
               ptxas         .     24 bytes stack frame, 16 bytes spill stores, 12 bytes spill loads\n\
               ptxas info    : Used 255 registers, used 1 barriers\n";
    let used = Resources::from_log(log).expect("a report");
    assert_eq!((used.registers, used.spilled), (255, 16));
    assert!(Resources::from_log("ptxas info    : 0 bytes gmem\n").is_none());
}
