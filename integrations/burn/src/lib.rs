//! Data-parallel training of [burn](https://burn.dev) models with gradpack's compressed
//! gradient sync.
//!
//! Every worker (a thread, or an MPI rank) holds the whole model and computes gradients
//! on its own share of the batch. [`GradSync`] takes a worker's gradients after
//! `backward()`, hands each parameter's gradient to gradpack's
//! [`SyncEngine`](gradpack::sync::SyncEngine) as it visits the module (a bucket starts its
//! compressed all-reduce on the engine's communication thread as soon as it is full),
//! and returns the mean gradients for the optimizer. Every worker gets the same mean, bit
//! for bit, so the replicas never drift apart.
//!
//! ```ignore
//! let mut sync = GradSync::new(&model, transport, SyncOptions::default())?;
//! for batch in batches {
//!     let loss = model.forward_loss(batch);
//!     let grads = GradientsParams::from_grads(loss.backward(), &model);
//!     let grads = sync.sync(&model, grads)?; // the one new line
//!     model = optimizer.step(lr, model, grads);
//! }
//! ```
//!
//! The codec of each parameter, the buckets, error feedback, overlap and the network
//! model are the engine's [`SyncOptions`]; [`GradSync::save`] and [`GradSync::restore`]
//! checkpoint its state (step counter, error-feedback residuals) beside the model's
//! record.
//!
//! ## Low-communication training
//! [`DiLoCo`] runs gradpack's outer synchroniser ([`gradpack::outer`]) instead: each
//! worker trains alone, and every `H` steps the workers all-reduce their compressed
//! pseudo-gradients and take an outer optimizer step (DiLoCo, streaming DiLoCo,
//! SparseLoCo), all by [`OuterOptions`]:
//!
//! ```ignore
//! let mut diloco = DiLoCo::new(&model, transport, OuterOptions { sync_every: 50, ..Default::default() })?;
//! for batch in batches {
//!     let grads = GradientsParams::from_grads(model.forward_loss(batch).backward(), &model);
//!     model = optimizer.step(lr, model, grads); // the worker's own step
//!     model = diloco.step(model)?;              // the one new line
//! }
//! ```

use std::fmt;

use burn::module::ModuleMapper;
use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use gradpack::collective::Transport;
use gradpack::outer::OuterSync;
pub use gradpack::outer::{OuterOptions, OuterStats};
use gradpack::sync::{Plan, StepStats, SyncEngine, SyncOptions, Tensor as Layout};

/// What can go wrong in a sync.
#[derive(Debug)]
pub enum Error {
    /// The sync engine or its collective failed (a peer left, a frame was corrupt, ...).
    Sync(gradpack::Error),
    /// The module does not match the one the [`GradSync`] was made for.
    Layout(String),
    /// A gradient could not be read as f32.
    Data(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Sync(e) => write!(f, "gradient sync: {e}"),
            Error::Layout(s) => write!(f, "module layout: {s}"),
            Error::Data(s) => write!(f, "gradient data: {s}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Sync(e) => Some(e),
            _ => None,
        }
    }
}

impl From<gradpack::Error> for Error {
    fn from(e: gradpack::Error) -> Self {
        Error::Sync(e)
    }
}

/// This crate's result.
pub type Result<T> = std::result::Result<T, Error>;

/// One float parameter as the visitor met it.
#[derive(Debug, Clone)]
struct ParamInfo {
    id: ParamId,
    name: String,
    shape: Vec<usize>,
}

/// Collects every float parameter with its dotted path.
struct Collect {
    path: Vec<String>,
    params: Vec<ParamInfo>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Collect {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.path.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let mut name = self.path.join(".");
        if name.is_empty() {
            name = format!("param{}", self.params.len());
        }
        self.params.push(ParamInfo {
            id: param.id,
            name,
            shape: param.val().dims().to_vec(),
        });
    }
}

/// The float parameters of `module`, in the order [`ModuleVisitor`] visits them, as the
/// sync engine's layout (dotted names such as `fc1.weight`, and shapes).
pub fn layout<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M) -> Vec<Layout> {
    params::<B, M>(module)
        .into_iter()
        .map(|p| Layout::new(p.name, &p.shape))
        .collect()
}

fn params<B: AutodiffBackend, M: AutodiffModule<B>>(module: &M) -> Vec<ParamInfo> {
    let mut c = Collect {
        path: Vec::new(),
        params: Vec::new(),
    };
    module.visit::<Collect>(&mut c);
    c.params
}

/// Hands each parameter's gradient to the engine as it is visited.
struct Feed<'a, B: AutodiffBackend, T: Transport + Send + 'static> {
    engine: &'a mut SyncEngine<T>,
    grads: &'a mut GradientsParams,
    ids: &'a [ParamId],
    next: usize,
    error: Option<Error>,
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend, T: Transport + Send + 'static> ModuleVisitor<B> for Feed<'_, B, T> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let i = self.next;
        self.next += 1;
        if self.error.is_some() {
            return;
        }
        if self.ids.get(i) != Some(&param.id) {
            self.error = Some(Error::Layout(format!(
                "parameter {i} is not the one this GradSync was made for"
            )));
            return;
        }
        let r = match self.grads.remove::<B::InnerBackend, D>(param.id) {
            // A parameter that took no part in this worker's loss: a zero gradient (the
            // other workers' may not be zero; the mean is still right).
            None => self
                .engine
                .slot_mut(i)
                .map(|s| s.fill(0.0))
                .and_then(|_| self.engine.mark_ready(i)),
            Some(g) => {
                let data = g.into_data().convert::<f32>();
                match data.as_slice::<f32>() {
                    Ok(s) => self.engine.ready(i, s),
                    Err(e) => {
                        self.error = Some(Error::Data(format!("{e:?}")));
                        return;
                    }
                }
            }
        };
        if let Err(e) = r {
            self.error = Some(e.into());
        }
    }
}

/// Writes the reduced gradients back.
struct Write<'a, B: AutodiffBackend, T: Transport + Send + 'static> {
    engine: &'a SyncEngine<T>,
    grads: &'a mut GradientsParams,
    next: usize,
    error: Option<Error>,
    _b: std::marker::PhantomData<B>,
}

impl<B: AutodiffBackend, T: Transport + Send + 'static> ModuleVisitor<B> for Write<'_, B, T> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let i = self.next;
        self.next += 1;
        if self.error.is_some() {
            return;
        }
        match self.engine.grad(i) {
            Ok(g) => {
                let t = param.val();
                let data = TensorData::new(g.to_vec(), t.dims());
                let g = Tensor::<B::InnerBackend, D>::from_data(data, &t.device());
                self.grads.register::<B::InnerBackend, D>(param.id, g);
            }
            Err(e) => self.error = Some(e.into()),
        }
    }
}

/// Data-parallel gradient sync of one burn model over one transport (see the crate
/// docs). Every worker makes one with the same module structure and options.
pub struct GradSync<T: Transport + Send + 'static> {
    engine: SyncEngine<T>,
    ids: Vec<ParamId>,
    last: Option<StepStats>,
}

impl<T: Transport + Send + 'static> GradSync<T> {
    /// A sync for `module`'s float parameters over `transport`. Collective when the
    /// policy is `auto` without profiles (the engine measures and averages codec speeds).
    pub fn new<B: AutodiffBackend, M: AutodiffModule<B>>(
        module: &M,
        transport: T,
        opts: SyncOptions,
    ) -> Result<Self> {
        let ps = params::<B, M>(module);
        let layout: Vec<Layout> = ps.iter().map(|p| Layout::new(&p.name, &p.shape)).collect();
        let engine = SyncEngine::new(&layout, transport, opts)?;
        Ok(GradSync {
            engine,
            ids: ps.into_iter().map(|p| p.id).collect(),
            last: None,
        })
    }

    /// Reduce this worker's gradients with every other worker's: each parameter's
    /// gradient goes to the engine as the module is visited, and the mean over the
    /// workers comes back in the returned gradients, ready for the optimizer.
    pub fn sync<B: AutodiffBackend, M: AutodiffModule<B>>(
        &mut self,
        module: &M,
        mut grads: GradientsParams,
    ) -> Result<GradientsParams> {
        let mut feed = Feed::<B, T> {
            engine: &mut self.engine,
            grads: &mut grads,
            ids: &self.ids,
            next: 0,
            error: None,
            _b: std::marker::PhantomData,
        };
        module.visit(&mut feed);
        let (seen, error) = (feed.next, feed.error.take());
        if let Some(e) = error {
            return Err(e);
        }
        if seen != self.ids.len() {
            return Err(Error::Layout(format!(
                "the module has {seen} float parameters, this GradSync {}",
                self.ids.len()
            )));
        }
        self.last = Some(self.engine.finish()?);
        let mut out = GradientsParams::new();
        let mut write = Write::<B, T> {
            engine: &self.engine,
            grads: &mut out,
            next: 0,
            error: None,
            _b: std::marker::PhantomData,
        };
        module.visit(&mut write);
        if let Some(e) = write.error {
            return Err(e);
        }
        Ok(out)
    }

    /// The engine's plan: buckets, codecs, strategies and modelled times.
    pub fn plan(&self) -> &Plan {
        self.engine.plan()
    }

    /// What the last step sent.
    pub fn last_stats(&self) -> Option<StepStats> {
        self.last
    }

    /// Steps synced so far.
    pub fn step(&self) -> u64 {
        self.engine.step()
    }

    /// The engine's state (step counter, residuals) as a checkpoint blob.
    pub fn save(&mut self) -> Result<Vec<u8>> {
        Ok(self.engine.save()?)
    }

    /// Restore a blob of [`GradSync::save`] from a sync of the same model and options.
    pub fn restore(&mut self, blob: &[u8]) -> Result<()> {
        Ok(self.engine.restore(blob)?)
    }

    /// The underlying engine.
    pub fn engine(&self) -> &SyncEngine<T> {
        &self.engine
    }
}

/// Reads the parameters marked `wanted` into host buffers.
struct Read<'a> {
    ids: &'a [ParamId],
    wanted: &'a [bool],
    host: &'a mut [Vec<f32>],
    next: usize,
    error: Option<Error>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Read<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let i = self.next;
        self.next += 1;
        if self.error.is_some() || !self.wanted.get(i).copied().unwrap_or(true) {
            return;
        }
        if self.ids.get(i) != Some(&param.id) {
            self.error = Some(Error::Layout(format!(
                "parameter {i} is not the one this DiLoCo was made for"
            )));
            return;
        }
        let data = param.val().into_data().convert::<f32>();
        match data.as_slice::<f32>() {
            Ok(v) if v.len() == self.host[i].len() => self.host[i].copy_from_slice(v),
            Ok(v) => {
                self.error = Some(Error::Layout(format!(
                    "parameter {i} has {} elements, {} when this DiLoCo was made",
                    v.len(),
                    self.host[i].len()
                )))
            }
            Err(e) => self.error = Some(Error::Data(format!("{e:?}"))),
        }
    }
}

/// Replaces the parameters marked `wanted` by the host buffers' values.
struct Put<'a> {
    wanted: &'a [bool],
    host: &'a [Vec<f32>],
    next: usize,
}

impl<B: AutodiffBackend> ModuleMapper<B> for Put<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let i = self.next;
        self.next += 1;
        if !self.wanted.get(i).copied().unwrap_or(false) {
            return param;
        }
        let host = &self.host[i];
        param.map(|t| {
            let grad = t.is_require_grad();
            let data = TensorData::new(host.clone(), t.dims());
            let t = Tensor::<B, D>::from_data(data, &t.device());
            if grad { t.require_grad() } else { t }
        })
    }
}

/// DiLoCo's outer synchronisation of one burn model over one transport (see the crate
/// docs and [`gradpack::outer`]): call [`DiLoCo::step`] after every optimizer step.
/// Every worker makes one with the same module structure and options, from the same
/// parameters.
pub struct DiLoCo<T: Transport + Send + 'static> {
    outer: OuterSync<T>,
    ids: Vec<ParamId>,
    /// The parameters as the synchroniser reads and writes them.
    host: Vec<Vec<f32>>,
    fragments: Vec<Vec<usize>>,
    last: Option<OuterStats>,
    bytes_sent: u64,
}

impl<T: Transport + Send + 'static> DiLoCo<T> {
    /// A synchroniser for `module`'s float parameters, whose outer copy starts as
    /// their values, over `transport`.
    pub fn new<B: AutodiffBackend, M: AutodiffModule<B>>(
        module: &M,
        transport: T,
        opts: OuterOptions,
    ) -> Result<Self> {
        let ps = params::<B, M>(module);
        let layout: Vec<Layout> = ps.iter().map(|p| Layout::new(&p.name, &p.shape)).collect();
        let ids: Vec<ParamId> = ps.iter().map(|p| p.id).collect();
        let mut host = Vec::with_capacity(layout.len());
        for t in &layout {
            host.push(vec![0.0f32; t.len()?]);
        }
        let wanted = vec![true; ids.len()];
        read::<B, M>(module, &ids, &wanted, &mut host)?;
        let views: Vec<&[f32]> = host.iter().map(Vec::as_slice).collect();
        let outer = OuterSync::new(&layout, &views, transport, opts)?;
        let fragments = outer.fragments();
        Ok(DiLoCo {
            outer,
            ids,
            host,
            fragments,
            last: None,
            bytes_sent: 0,
        })
    }

    /// After an optimizer step: at a fragment's formation step its parameters are read
    /// and its all-reduce started; at its sync point the outer step is taken and its
    /// parameters replaced in the returned module. Other steps touch nothing.
    pub fn step<B: AutodiffBackend, M: AutodiffModule<B>>(&mut self, module: M) -> Result<M> {
        let due = self.outer.due();
        let n = self.ids.len();
        if due.is_empty() {
            self.last = Some(self.outer.step(&mut [])?);
            return Ok(module);
        }
        let mut read_set = vec![false; n];
        let mut write_set = vec![false; n];
        for &f in &due.send {
            self.fragments[f].iter().for_each(|&t| read_set[t] = true);
        }
        for &f in &due.apply {
            self.fragments[f].iter().for_each(|&t| {
                read_set[t] = true;
                write_set[t] = true;
            });
        }
        read::<B, M>(&module, &self.ids, &read_set, &mut self.host)?;
        let mut views: Vec<&mut [f32]> = self.host.iter_mut().map(Vec::as_mut_slice).collect();
        let stats = self.outer.step(&mut views)?;
        self.bytes_sent += stats.bytes_sent;
        self.last = Some(stats);
        let mut put = Put {
            wanted: &write_set,
            host: &self.host,
            next: 0,
        };
        Ok(module.map(&mut put))
    }

    /// What the last step did.
    pub fn last_stats(&self) -> Option<OuterStats> {
        self.last
    }

    /// Bytes sent for outer steps so far (by this synchroniser; not saved).
    pub fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }

    /// Inner steps so far.
    pub fn inner_step(&self) -> u64 {
        self.outer.inner_step()
    }

    /// The outer copy of parameter `i` (in visiting order).
    pub fn outer(&self, i: usize) -> Result<&[f32]> {
        Ok(self.outer.outer(i)?)
    }

    /// The synchroniser's state as a checkpoint blob (see [`OuterSync::save`]), to
    /// keep beside the model's and the optimizer's records.
    pub fn save(&mut self) -> Result<Vec<u8>> {
        Ok(self.outer.save()?)
    }

    /// Restore a blob of [`DiLoCo::save`] from a synchroniser of the same model and
    /// options; with the model and optimizer of the same step, training continues bit
    /// for bit.
    pub fn restore(&mut self, blob: &[u8]) -> Result<()> {
        Ok(self.outer.restore(blob)?)
    }
}

fn read<B: AutodiffBackend, M: AutodiffModule<B>>(
    module: &M,
    ids: &[ParamId],
    wanted: &[bool],
    host: &mut [Vec<f32>],
) -> Result<()> {
    let mut r = Read {
        ids,
        wanted,
        host,
        next: 0,
        error: None,
    };
    module.visit::<Read>(&mut r);
    if let Some(e) = r.error {
        return Err(e);
    }
    if r.next != ids.len() {
        return Err(Error::Layout(format!(
            "the module has {} float parameters, this DiLoCo {}",
            r.next,
            ids.len()
        )));
    }
    Ok(())
}
