#!/usr/bin/env node
// Checks Chrome Trace Event Format JSON files (ctxplan timeline -o, ctxtrain --trace) in two ways:
//   1. structurally, in this script: the JSON parses; every event has the fields its phase needs
//      (X: name ph ts dur pid tid; M: a known metadata name with args.name / args.sort_index;
//      C: name ts pid and numeric args); ts/dur are finite numbers >= 0; no NaN in X events;
//      X events on one thread nest (a slice that starts inside another ends inside it too);
//   2. in a real viewer: speedscope's static web app, served from node_modules on a localhost
//      HTTP server together with the trace, opened in headless Chromium as
//      index.html#profileURL=<trace url>. It must import the file without an alert, an exception,
//      "Something went wrong" or mis-nesting warnings, and its profile selector must list one view
//      per thread with events, named from the file's process_name / thread_name metadata.
//      A screenshot of the view it opened is written to FILE.speedscope.png (or --screenshot).
//
// Usage: node check.mjs [--screenshot PATH] [--title TEXT] [--timeout SEC] [--chromium PATH]
//                       [--no-browser] [--verbose] FILE...
// Prints one line per file: "OK   FILE: ..." on stdout, or "FAIL FILE: <problem>; ..." on stderr.
// Exits 0 only if every file passes.
//
// Note on --title: speedscope 1.25 renames *every* view to the title when #title= is given
// (App.loadProfile: profile.setName(hashParams.title || profile.getName())), so thread names can
// then not be checked; without --title the check verifies them and only sets document.title.

import fs from 'node:fs'
import http from 'node:http'
import path from 'node:path'
import { fileURLToPath } from 'node:url'

const here = path.dirname(fileURLToPath(import.meta.url))

// ---------------------------------------------------------------- arguments
function usage(msg) {
  if (msg) console.error(`check.mjs: ${msg}`)
  console.error(
    'usage: node check.mjs [--screenshot PATH] [--title TEXT] [--timeout SEC] [--chromium PATH] [--no-browser] [--verbose] FILE...',
  )
  process.exit(2)
}
const opts = {
  files: [],
  screenshot: null,
  title: null,
  timeoutS: 180,
  chromium: process.env.CHROMIUM || '/usr/bin/chromium',
  browser: true,
  verbose: false,
}
{
  const a = process.argv.slice(2)
  for (let i = 0; i < a.length; i++) {
    const need = () => (i + 1 < a.length ? a[++i] : usage(`${a[i]} needs a value`))
    switch (a[i]) {
      case '--screenshot': opts.screenshot = need(); break
      case '--title': opts.title = need(); break
      case '--timeout': opts.timeoutS = Number(need()); break
      case '--chromium': opts.chromium = need(); break
      case '--no-browser': opts.browser = false; break
      case '--verbose': case '-v': opts.verbose = true; break
      case '-h': case '--help': usage()
      default:
        if (a[i].startsWith('--')) usage(`unknown option ${a[i]}`)
        opts.files.push(a[i])
    }
  }
  if (opts.files.length === 0) usage('no trace file given')
  if (opts.screenshot && opts.files.length > 1) usage('--screenshot takes one FILE only')
  if (!(opts.timeoutS > 0)) usage('--timeout must be a positive number of seconds')
}

// ---------------------------------------------------------------- structural check
const isNum = v => typeof v === 'number' && Number.isFinite(v)
const isNaNish = v =>
  v === null || (typeof v === 'number' && !Number.isFinite(v)) ||
  (typeof v === 'string' && /^[-+]?(nan|inf(inity)?)$/i.test(v.trim()))
const KNOWN_PHASES = new Set('BEXiIbenSTpFsftPONDMCRcVv()'.split(''))
const METADATA = {
  process_name: 'name', thread_name: 'name', process_labels: 'labels',
  process_sort_index: 'sort_index', thread_sort_index: 'sort_index', process_uptime_seconds: 'uptime',
}
const short = (s, n = 100) => (s.length > n ? s.slice(0, n - 3) + '...' : s)

// Returns { problems: [string], counts: {ph: n}, procNames: Map, threadNames: Map,
//           threads: Map<"pid:tid", {pid, tid, x}>, events }
function structuralCheck(file) {
  const problems = []
  const counts = {}
  const res = { problems, counts, procNames: new Map(), threadNames: new Map(), threads: new Map(), events: null }
  let text
  try {
    text = fs.readFileSync(file, 'utf8')
  } catch (e) {
    problems.push(`cannot read: ${e.message}`)
    return res
  }
  let doc
  try {
    doc = JSON.parse(text)
  } catch (e) {
    let hint = ''
    const m = /(?<![\w"])(-?(?:NaN|Infinity|nan|inf))(?![\w"])/.exec(text)
    if (m) {
      const line = text.slice(0, m.index).split('\n').length
      hint = ` (found bare ${m[1]} at line ${line}, offset ${m.index}: JSON has no NaN/Infinity)`
    }
    problems.push(`JSON does not parse: ${e.message}${hint}`)
    return res
  }
  let events
  if (Array.isArray(doc)) events = doc
  else if (doc && typeof doc === 'object' && Array.isArray(doc.traceEvents)) {
    events = doc.traceEvents
    if ('displayTimeUnit' in doc && !['ms', 'ns'].includes(doc.displayTimeUnit))
      problems.push(`displayTimeUnit is ${JSON.stringify(doc.displayTimeUnit)}, must be "ms" or "ns"`)
  } else {
    problems.push('top level is neither an array of events nor an object with a traceEvents array')
    return res
  }
  if (events.length === 0) problems.push('traceEvents is empty')
  res.events = events

  // Per-kind problem tallies so one line can name each kind once with a count and an example.
  const tally = new Map()
  const bad = (kind, i, e, detail) => {
    const t = tally.get(kind)
    if (t) t.n++
    else tally.set(kind, { n: 1, ex: `event #${i} ${short(JSON.stringify(e))}${detail ? ` (${detail})` : ''}` })
  }
  const needStr = (e, k) => typeof e[k] === 'string' && e[k].length > 0
  const needInt = (e, k) => Number.isInteger(e[k])
  const checkTs = (e, i, ph, required) => {
    if (!('ts' in e)) { if (required) bad(`${ph} event without ts`, i, e); return }
    if (!isNum(e.ts)) bad(`${ph} event with non-numeric ts`, i, e, `ts=${JSON.stringify(e.ts)}`)
    else if (e.ts < 0) bad(`${ph} event with ts < 0`, i, e)
  }

  events.forEach((e, i) => {
    if (!e || typeof e !== 'object' || Array.isArray(e)) { bad('event that is not an object', i, e); return }
    const ph = e.ph
    if (typeof ph !== 'string') { bad('event without ph', i, e); return }
    counts[ph] = (counts[ph] || 0) + 1
    if (!KNOWN_PHASES.has(ph)) { bad(`unknown phase "${ph}"`, i, e); return }
    switch (ph) {
      case 'X': {
        for (const k of ['name', 'ph', 'ts', 'dur', 'pid', 'tid']) if (!(k in e)) bad(`X event without ${k}`, i, e)
        if ('name' in e && !needStr(e, 'name')) bad('X event with empty/non-string name', i, e)
        for (const k of ['pid', 'tid']) if (k in e && !needInt(e, k)) bad(`X event with non-integer ${k}`, i, e)
        checkTs(e, i, 'X', true)
        if ('dur' in e) {
          if (!isNum(e.dur)) bad('X event with non-numeric dur', i, e, `dur=${JSON.stringify(e.dur)}`)
          else if (e.dur < 0) bad('X event with dur < 0', i, e)
        }
        const nanArgs = e.args && typeof e.args === 'object'
          ? Object.entries(e.args).filter(([, v]) => isNaNish(v)).map(([k]) => k) : []
        if (nanArgs.length) bad('X event with NaN/Inf/null in args', i, e, `args ${nanArgs.join(',')}`)
        if ('args' in e && (typeof e.args !== 'object' || e.args === null || Array.isArray(e.args)))
          bad('X event whose args is not an object', i, e)
        if (needInt(e, 'pid') && needInt(e, 'tid') && isNum(e.ts) && isNum(e.dur)) {
          const key = `${e.pid}:${e.tid}`
          if (!res.threads.has(key)) res.threads.set(key, { pid: e.pid, tid: e.tid, x: [] })
          res.threads.get(key).x.push(i)
        }
        break
      }
      case 'B': case 'E': {
        for (const k of ['pid', 'tid']) if (!needInt(e, k)) bad(`${ph} event without integer ${k}`, i, e)
        if (ph === 'B' && !needStr(e, 'name')) bad('B event without name', i, e)
        checkTs(e, i, ph, true)
        if (needInt(e, 'pid') && needInt(e, 'tid')) {
          const key = `${e.pid}:${e.tid}`
          if (!res.threads.has(key)) res.threads.set(key, { pid: e.pid, tid: e.tid, x: [] })
        }
        break
      }
      case 'M': {
        if (!needStr(e, 'name')) { bad('M event without name', i, e); break }
        const argKey = METADATA[e.name]
        if (!argKey) { bad(`M event with unknown name "${e.name}"`, i, e); break }
        if (!needInt(e, 'pid')) bad('M event without integer pid', i, e)
        if (e.name.startsWith('thread_') && !needInt(e, 'tid')) bad(`M ${e.name} event without integer tid`, i, e)
        if (!e.args || typeof e.args !== 'object' || !(argKey in e.args)) { bad(`M ${e.name} event without args.${argKey}`, i, e); break }
        const v = e.args[argKey]
        if (argKey === 'name' || argKey === 'labels') {
          if (typeof v !== 'string' || v.length === 0) bad(`M ${e.name} event whose args.${argKey} is not a non-empty string`, i, e)
        } else if (!isNum(v)) bad(`M ${e.name} event whose args.${argKey} is not a number`, i, e)
        if ('ts' in e) checkTs(e, i, 'M', false)
        if (e.name === 'process_name' && typeof v === 'string') res.procNames.set(e.pid, v)
        if (e.name === 'thread_name' && typeof v === 'string') res.threadNames.set(`${e.pid}:${e.tid}`, v)
        break
      }
      case 'C': {
        if (!needStr(e, 'name')) bad('C event without name', i, e)
        if (!needInt(e, 'pid')) bad('C event without integer pid', i, e)
        checkTs(e, i, 'C', true)
        if (!e.args || typeof e.args !== 'object' || Array.isArray(e.args) || Object.keys(e.args).length === 0)
          bad('C event without args', i, e)
        else {
          const nonNum = Object.entries(e.args).filter(([, v]) => !isNum(v)).map(([k, v]) => `${k}=${JSON.stringify(v)}`)
          if (nonNum.length) bad('C event with non-numeric args', i, e, nonNum.join(','))
        }
        break
      }
      default:
        // other phases: only the fields every event shares
        if ('ts' in e) checkTs(e, i, ph, false)
    }
  })

  // Nesting: on one thread, an X event that starts inside another must end inside it
  // (both speedscope and Perfetto build one call stack per thread). Ends are computed as
  // ts + dur in doubles, exactly as a viewer does.
  for (const [key, th] of res.threads) {
    if (th.x.length < 2) continue
    const xs = th.x.map(i => events[i])
    xs.sort((a, b) => a.ts - b.ts || b.dur - a.dur)
    // speedscope re-bases each thread to its first event (ts - min ts) before adding dur; count the
    // back-to-back slices that nest in the file but overlap after that subtraction (float rounding)
    const t0 = xs[0].ts
    for (let j = 1; j < xs.length; j++) {
      const a = xs[j - 1], b = xs[j]
      if (a.ts + a.dur <= b.ts && (a.ts - t0) + a.dur > b.ts - t0) {
        res.rebaseOverlaps = (res.rebaseOverlaps || 0) + 1
        res.rebaseThreads = res.rebaseThreads || new Set()
        res.rebaseThreads.add(`pid ${th.pid} tid ${th.tid}`)
      }
    }
    const stack = []
    let n = 0, maxOver = 0, ex = null
    for (const e of xs) {
      while (stack.length && stack[stack.length - 1].ts + stack[stack.length - 1].dur <= e.ts) stack.pop()
      const top = stack[stack.length - 1]
      if (top && e.ts + e.dur > top.ts + top.dur) {
        n++
        const over = top.ts + top.dur - e.ts
        maxOver = Math.max(maxOver, over)
        if (!ex) ex = `"${top.name}" ts=${top.ts} dur=${top.dur} ends at ${top.ts + top.dur} after "${e.name}" starts at ts=${e.ts}`
        // keep going the way a viewer with a strict stack would: the later slice is not a child
        stack.pop()
      }
      stack.push(e)
    }
    if (n) {
      const tname = res.threadNames.get(key)
      const o = +maxOver.toPrecision(3)
      th.overlaps = n
      bad(`X events partially overlap on one thread`, -1, null, null)
      const t = tally.get('X events partially overlap on one thread')
      const part = `pid ${th.pid} tid ${th.tid}${tname ? ` (${tname})` : ''}: ${n} (max ${o} us)`
      if (t.n === 1) { t.ex = `e.g. ${ex}`; t.parts = [part] } else t.parts.push(part)
    }
  }

  for (const [kind, t] of tally) {
    if (t.parts) problems.push(`${kind}: ${t.parts.join(', ')}; ${t.ex}`)
    else problems.push(`${t.n} × ${kind}, first: ${t.ex}`)
  }
  return res
}

// Speedscope's name for a thread's view (importer's profile naming for trace events).
function speedscopeViewName(procName, threadName, pid, tid) {
  if (procName != null && threadName != null) return `${procName} (pid ${pid}), ${threadName} (tid ${tid})`
  if (procName != null) return `${procName} (pid ${pid}, tid ${tid})`
  if (threadName != null) return `${threadName} (pid ${pid}, tid ${tid})`
  return `pid ${pid}, tid ${tid}`
}

// "P (pid 1), compute (tid 0)" x N  ->  "P (pid 1): compute, h2d | Q (pid 2): compute"
function summarizeViews(names) {
  const groups = new Map()
  const loose = []
  for (const n of names) {
    const m = /^(.*) \(pid (\S+)\), (.*) \(tid (\S+)\)$/.exec(n)
    if (!m) { loose.push(n); continue }
    const k = `${m[1]} (pid ${m[2]})`
    if (!groups.has(k)) groups.set(k, [])
    groups.get(k).push(m[3])
  }
  return [...[...groups].map(([k, v]) => `${k}: ${v.join(', ')}`), ...loose].join(' | ')
}

// ---------------------------------------------------------------- speedscope in Chromium
const ssRoot = path.join(here, 'node_modules', 'speedscope', 'dist', 'release')
const ssVersion = (() => {
  try { return JSON.parse(fs.readFileSync(path.join(here, 'node_modules', 'speedscope', 'package.json'), 'utf8')).version }
  catch { return '?' }
})()
const MIME = {
  '.html': 'text/html; charset=utf-8', '.js': 'text/javascript; charset=utf-8', '.css': 'text/css',
  '.json': 'application/json', '.png': 'image/png', '.ico': 'image/x-icon', '.woff2': 'font/woff2',
  '.wasm': 'application/wasm', '.txt': 'text/plain', '.md': 'text/plain',
}

function startServer(traces) {
  // traces: Map<urlPath, absolute file path>
  const server = http.createServer((req, res) => {
    let p
    try { p = decodeURIComponent(new URL(req.url, 'http://localhost').pathname) } catch { p = '' }
    let file = traces.get(p)
    if (!file) {
      const rel = path.normalize(p === '/' ? '/index.html' : p)
      const abs = path.join(ssRoot, rel)
      if (abs.startsWith(ssRoot + path.sep)) file = abs
    }
    if (!file) { res.writeHead(404); res.end(); return }
    fs.stat(file, (err, st) => {
      if (err || !st.isFile()) { res.writeHead(404); res.end(); return }
      res.writeHead(200, {
        'Content-Type': MIME[path.extname(file)] || 'application/octet-stream',
        'Content-Length': st.size, 'Cache-Control': 'no-store',
      })
      fs.createReadStream(file).pipe(res)
    })
  })
  return new Promise((resolve, reject) => {
    server.once('error', reject)
    server.listen(0, '127.0.0.1', () => resolve(server))
  })
}

const stripArgs = s => s.replace(/ \{.*?\}(?=")/g, '') // 'ts=1: Tried to end "op {json}"' -> '"op"'

async function speedscopeCheck(browser, base, urlPath, shotPath, expected, st) {
  const problems = []
  const out = { problems, views: [], importMs: null }
  const ctx = await browser.newContext({ viewport: { width: 1600, height: 1000 } })
  const page = await ctx.newPage()
  const logs = []
  let importWarnings = 0, leftOpen = 0, badEnds = 0, firstImportWarning = null, loadError = null, dialog = null, pageError = null
  let done, doneP = new Promise(r => (done = r))
  page.on('console', m => {
    const t = m.text()
    logs.push(`${m.type()}: ${t}`)
    if (m.type() === 'warning' && /Tried to end|still open at end of profile|stack was empty|Ignoring ProfileChunk/.test(t)) {
      importWarnings++
      if (t.includes('still open at end of profile')) leftOpen++
      else if (t.includes('Tried to end')) badEnds++
      if (!firstImportWarning) firstImportWarning = t
    }
    let mm
    if ((mm = /^import: ([\d.]+) ?ms/.exec(t))) { out.importMs = Number(mm[1]); done('imported') }
    if (t.startsWith('Failed to load format')) { loadError = t.replace(/^Failed to load format\s*/, '').split('\n')[0]; done('error') }
    if (/Failed to create WebGL context/.test(t)) { loadError = t.split('\n')[0]; done('error') }
  })
  page.on('pageerror', e => { pageError = e.message; done('error') })
  page.on('crash', () => { pageError = 'page crashed'; done('error') })
  page.on('dialog', d => { dialog = d.message(); d.dismiss().catch(() => {}); done('dialog') })

  const traceUrl = `${base}${urlPath}`
  let hash = `profileURL=${encodeURIComponent(traceUrl)}`
  if (opts.title) hash += `&title=${encodeURIComponent(opts.title)}`
  await page.goto(`${base}/index.html#${hash}`, { waitUntil: 'load' })
  // speedscope also shows its error panel without logging (e.g. WebGL unavailable): poll for it
  const poll = (async () => {
    for (;;) {
      await new Promise(r => setTimeout(r, 250))
      const txt = await page.evaluate(() => document.body.innerText).catch(() => '')
      if (txt.includes('Something went wrong')) return 'error panel'
    }
  })()
  const timeout = new Promise(r => setTimeout(() => r('timeout'), opts.timeoutS * 1000))
  const how = await Promise.race([doneP, poll, timeout])
  // let the first frame render and late console messages arrive
  await page.waitForTimeout(how === 'imported' ? 1000 : 300)

  const dom = await page.evaluate(() => {
    const body = document.body.innerText
    const input = document.querySelector('input[placeholder="Filter..."]')
    const table = input && input.closest('div') && input.closest('div').parentElement.querySelector('table')
    const rows = table ? [...table.querySelectorAll('tbody tr')].map(tr => {
      const tds = tr.querySelectorAll('td')
      return { name: tr.getAttribute('title') || (tds[1] ? tds[1].textContent : ''), weight: tds[2] ? tds[2].textContent : '' }
    }) : []
    // the toolbar (view-mode buttons | current view name | Export/Import) names the view shown;
    // with a single view speedscope renders no selector table, only this name
    let current = ''
    const tb = [...document.querySelectorAll('div')].find(d => d.children.length >= 2 &&
      d.firstElementChild.textContent.includes('Time Order') && d.lastElementChild.textContent.includes('Import'))
    if (tb) {
      const mid = [...tb.childNodes].slice(1, -1)
      const c = mid.length === 1 && mid[0].nodeType === 1 && mid[0].firstChild ? mid[0].firstChild : null
      current = (c ? c.textContent : mid.map(n => n.textContent).join('')).replace(/\s*\(\d+\/\d+\)\s*$/, '').trim()
    }
    if (rows.length === 0 && current) rows.push({ name: current, weight: '' })
    return { body, rows, current, title: document.title }
  }).catch(e => ({ body: '', rows: [], title: '', err: e.message }))

  if (shotPath) await page.screenshot({ path: shotPath }).catch(e => problems.push(`screenshot failed: ${e.message}`))
  out.logs = logs
  out.docTitle = dom.title

  if (dialog) problems.push(`speedscope alert: "${dialog}"`)
  if (loadError) problems.push(`speedscope import failed: ${loadError}`)
  if (pageError) problems.push(`speedscope page error: ${pageError}`)
  if (dom.body.includes('Something went wrong') && !loadError && !pageError)
    problems.push('speedscope shows "Something went wrong" (no error logged)')
  if (how === 'timeout') problems.push(`speedscope did not finish importing within ${opts.timeoutS} s`)
  if (importWarnings)
    problems.push(`speedscope mis-nested slices: ${importWarnings} import warnings (${badEnds} "Tried to end ... when ... was on the top of the stack", ` +
      `${leftOpen} slices "still open at end of profile", i.e. stretched to the end of the step)` +
      (st.rebaseOverlaps ? `, of which about ${st.rebaseOverlaps} come from back-to-back slices (end == next start) on ` +
        `${[...st.rebaseThreads].join(', ')} that nest in the file but overlap by float rounding after speedscope ` +
        `re-bases the thread (ts - first ts); times on a 2^-10 us grid avoid that` : '') +
      `; first: ${short(stripArgs(firstImportWarning), 160)}`)

  out.views = dom.rows.map(r => r.name)
  out.weights = dom.rows.map(r => r.weight)
  if (how === 'imported' && !loadError && !pageError && !dialog) {
    if (dom.rows.length === 0) problems.push('speedscope imported the file but its profile selector lists no views')
    else if (expected) {
      const got = new Set(out.views), want = new Set(expected)
      const missing = [...want].filter(n => !got.has(n)), extra = [...got].filter(n => !want.has(n))
      if (missing.length) problems.push(`speedscope lacks view(s) ${missing.map(n => `"${n}"`).join(', ')}`)
      if (extra.length) problems.push(`speedscope shows unexpected view(s) ${extra.map(n => `"${n}"`).join(', ')}`)
    }
  }
  await ctx.close()
  return out
}

// ---------------------------------------------------------------- main
const fmtCounts = c => {
  const order = ['X', 'M', 'C', 'B', 'E', 'i', 'I']
  const keys = Object.keys(c).sort((a, b) => (order.indexOf(a) + 1 || 99) - (order.indexOf(b) + 1 || 99))
  return keys.length ? keys.map(k => `${k} ${c[k]}`).join(', ') : 'no events'
}

let browser = null, server = null, failed = 0
const traceMap = new Map()
const jobs = opts.files.map((f, i) => {
  const abs = path.resolve(f)
  const urlPath = `/trace/${i}/${encodeURIComponent(path.basename(abs))}`
  traceMap.set(decodeURIComponent(urlPath), abs)
  return { file: f, abs, urlPath }
})

try {
  if (opts.browser) {
    if (!fs.existsSync(path.join(ssRoot, 'index.html')))
      throw new Error(`speedscope not installed at ${ssRoot} (run npm ci in ${here})`)
    if (!fs.existsSync(opts.chromium)) throw new Error(`no Chromium at ${opts.chromium} (set CHROMIUM or --chromium)`)
    const { chromium } = await import('playwright-core')
    server = await startServer(traceMap)
    browser = await chromium.launch({
      executablePath: opts.chromium,
      headless: true,
      // speedscope draws with WebGL; headless Chromium only offers it through SwiftShader
      args: ['--enable-unsafe-swiftshader', '--use-angle=swiftshader', '--disable-dev-shm-usage'],
    })
  }
  const base = server ? `http://127.0.0.1:${server.address().port}` : null

  for (const job of jobs) {
    const t0 = Date.now()
    const s = structuralCheck(job.abs)
    const problems = [...s.problems]
    let views = null, ss = null
    const expected = [...s.threads.values()].map(t =>
      opts.title ?? speedscopeViewName(s.procNames.get(t.pid), s.threadNames.get(`${t.pid}:${t.tid}`), t.pid, t.tid))
    const shot = opts.screenshot || `${job.file}.speedscope.png`
    if (browser && s.events) {
      ss = await speedscopeCheck(browser, base, job.urlPath, shot, expected, s)
      problems.push(...ss.problems)
      views = ss.views
    }
    const secs = ((Date.now() - t0) / 1000).toFixed(1)
    const counts = fmtCounts(s.counts)
    let viewTxt = ''
    if (ss) {
      viewTxt = views.length
        ? `; speedscope ${ssVersion}: ${views.length} view(s) [${summarizeViews(views)}]`
        : `; speedscope ${ssVersion}: no views`
      if (ss.importMs != null) viewTxt += `, import ${(ss.importMs / 1000).toFixed(1)} s`
      viewTxt += `; screenshot ${shot}`
    }
    if (problems.length) {
      failed++
      console.error(`FAIL ${job.file}: ${problems.join('; ')} [events: ${counts}${viewTxt}; ${secs} s]`)
    } else {
      console.log(`OK   ${job.file}: events ${counts}${viewTxt}; ${secs} s`)
    }
    if (opts.verbose && ss) {
      ss.views.forEach((v, i) => console.log(`       view ${i + 1}: ${v}  (total ${ss.weights[i]})`))
      const other = ss.logs.filter(l => !/Tried to end|still open at end/.test(l))
      other.forEach(l => console.log(`       console ${l.split('\n')[0]}`))
    }
  }
} catch (e) {
  console.error(`FAIL ${opts.files.join(' ')}: checker error: ${e.message.split('\n')[0]}`)
  failed = failed || 1
} finally {
  if (browser) await browser.close().catch(() => {})
  if (server) server.close()
}
process.exit(failed ? 1 : 0)
